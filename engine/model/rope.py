"""Rotary position embeddings, computed as Hugging Face does: default, linear, llama3,
dynamic (NTK), yarn and longrope.

The tables hold cos and sin for every position, already scaled by the type's
attention factor (yarn's mscale, longrope's), as transformers' rotary modules scale
them. Two types depend on the sequence's length in transformers:

    dynamic   frequencies change only past max_position_embeddings, which the engine
              never runs (max_model_len <= max_position_embeddings): the table is
              transformers' one at that length, where NTK's base is unchanged
    longrope  transformers picks, per forward, the long factors when the sequence's
              length exceeds original_max_position_embeddings, else the short ones;
              Phi-3's generate then recomputes the whole cache with the long factors
              the first time a sequence crosses (its prepare_inputs_for_generation).
              A paged engine that switched per sequence would hold K of both kinds for
              one context, and which kind a token got would depend on scheduling
              (prefill chunks, prefix-cache hits, preemption, speculative steps, the
              prefill worker of a P/D pair). So, as vLLM does, one set for the whole
              engine: the long factors when max_model_len exceeds
              original_max_position_embeddings, else the short ones. Every sequence
              longer than original_max_position_embeddings then gets exactly
              transformers' numbers (after Phi-3's recompute, for one that crosses
              while decoding), and a sequence that stays shorter gets them when
              max_model_len <= original_max_position_embeddings; an engine with a
              longer max_model_len computes short sequences with the long factors
              (the loader logs it).
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2]; `long`: longrope's long factors."""
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        if factors.numel() != head_dim // 2:
            raise ValueError(f"rope_parameters.{'long' if long else 'short'}_factor: {factors.numel()} values, "
                             f"head_dim {head_dim} needs {head_dim // 2}")
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (factors * rope.theta**shape)
    theta = _dynamic_base(rope, head_dim) if rope.rope_type == "dynamic" else rope.theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _dynamic_base(rope: RopeConfig, head_dim: int) -> float:
    """NTK's base at seq_len = max_position_embeddings (transformers' formula)."""
    seq_len = rope.max_position_embeddings
    scale = (rope.factor * seq_len / rope.max_position_embeddings) - (rope.factor - 1)
    return rope.theta * scale ** (head_dim / (head_dim - 2))


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """transformers' _compute_yarn_parameters, op for op."""
    base, factor = rope.theta, rope.factor

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _tables(inv_freq: torch.Tensor, scale: float, max_positions: int, device: torch.device):
    positions = torch.arange(max_positions, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def uses_long_factors(rope: RopeConfig, max_positions: int) -> bool:
    """Whether an engine of `max_positions` (max_model_len) runs longrope's long factors."""
    return rope.rope_type == "longrope" and max_positions > rope.original_max_position_embeddings


class RotaryEmbedding:
    """cos/sin tables for every position, looked up per token. `factors` is longrope's
    set ("long" or "short"; None for other types): two workers exchanging KV must agree
    on it (ModelRunner.kv_format)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device) -> None:
        long = uses_long_factors(rope, max_positions)
        self.factors = ("long" if long else "short") if rope.rope_type == "longrope" else None
        self.cos, self.sin = _tables(inv_frequencies(rope, head_dim, long=long), rope.attention_factor,
                                     max_positions, device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, D] for a step's tokens (looked up once per step).

        HF rotates with rotate_half(x) * sin = cat(-x2, x1) * cat(s, s); we compute the
        same products as roll(x) * cat(-s, s): bit-identical, fewer passes.
        """
        cos = self.cos[positions].to(dtype)[:, None, :]
        sin = self.sin[positions].to(dtype)[:, None, :]
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] as Hugging Face's apply_rotary_pos_emb does."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) over a paged KV cache.

Our own forward pass, numerically in step with Hugging Face's: the same op order
(pre-norm, residual adds, RMSNorm in float32), q/k/v and gate/up fused into one
matmul each. Input is a flat batch of tokens from many sequences (no padding).
The families differ only in ModelConfig's flags: q/k/v bias (Qwen2), per-head q/k
RMSNorm before RoPE (Qwen3), per-layer sliding windows (Mistral, Qwen), RoPE types
(Phi-3's longrope). Gemma's decoder (engine/model/gemma.py) builds on these classes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bit-identical to HF's op-by-op version (normalise in float32, cast, scale),
        # in one fused kernel.
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


Rotary = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sliding_window = cfg.sliding_windows[layer]
        # soft-capping (Gemma 2) goes to the backend only when the model has it
        self.softcap = {} if cfg.attn_logit_softcapping is None else {"softcap": cfg.attn_logit_softcapping}
        if cfg.qk_norm:  # per head, before RoPE (Qwen3, Gemma 3)
            self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps)
        # A float8 KV cache holds K / k_scale and V / v_scale (the checkpoint's, else 1.0).
        self.kv_scales = (1.0, 1.0)

    def forward(self, x, rotary: Rotary, kv: torch.Tensor, meta, backend: AttentionBackend):
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        if cfg.qk_norm:
            q, k = qkv[:, : cfg.q_size + cfg.kv_size].split([cfg.q_size, cfg.kv_size], dim=-1)
            q = apply_rotary(self.q_norm(q.view(-1, cfg.num_heads, cfg.head_dim)), *rotary)
            k = apply_rotary(self.k_norm(k.view(-1, cfg.num_kv_heads, cfg.head_dim)), *rotary)
        else:
            # q and k are adjacent columns: rotate both heads' sets in one pass
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            q, k = apply_rotary(qk, *rotary).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        o = backend.forward(q, k, v, kv, meta, self.scale, self.sliding_window, self.kv_scales, **self.softcap)
        return self.o_proj(o.reshape(-1, cfg.q_size))


ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma's GeGLU
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, rotary, kv, meta, backend):
        h = h + self.self_attn(self.input_layernorm(h), rotary, kv, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class FeatureCapture:
    """Hidden states a forward pass keeps for an EAGLE head, at every row of the flat
    batch (its output, `features` [T, F]), from the same pass that scores the tokens:

        layers   the residual stream entering each of these layers (EAGLE-3's aux
                 hidden states, vLLM's ids: id j = layer j's input, 0 = the embeddings;
                 concatenated in this order)
        final    the last layer's output after the final norm (EAGLE-1's feature),
                 after the layers' ones if both are asked
    """

    layers: tuple[int, ...] = ()
    final: bool = False
    features: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    """`rope_local`: the sliding-window layers' RoPE where it differs (Gemma 3)."""

    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, rope_local: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # Left uninitialised (the loader fills every weight from the checkpoint): nn.Embedding's
        # own normal_() init, run on the meta device, imports torch._dynamo, ~1 s of CPU per process.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rope
        self.rope_local = rope_local

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rotaries(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rotary]:
        """Each layer's cos/sin for the step (looked up once per RoPE)."""
        rotary = self.rope.lookup(positions, dtype)
        if self.rope_local is None:
            return [rotary] * len(self.layers)
        local = self.rope_local.lookup(positions, dtype)
        return [rotary if w is None else local for w in self.cfg.sliding_windows]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [L, num_blocks, 2, block_size, KVH, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # rows of the flat batch whose next-token logits are needed
        on_layer: Callable[[int], None] | None = None,
        capture: FeatureCapture | None = None,
    ) -> torch.Tensor:
        """`on_layer(i)` runs once layer i's K/V are in the cache (layer-wise KV streaming);
        `capture` gets the hidden states it names (`FeatureCapture.features`)."""
        h = self.embed(input_ids)
        rotaries = self.rotaries(positions, h.dtype)
        inputs: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture.layers:
                inputs[i] = h
            h = layer(h, rotaries[i], kv_cache[i], meta, backend)
            if on_layer is not None:
                on_layer(i)
        kept = [inputs[i] for i in capture.layers] if capture is not None else []
        if capture is not None and capture.final:
            h = self.norm(h)  # every row: the head reads each position's feature
            kept.append(h)
            h = h[logits_indices]
        else:
            h = self.norm(h[logits_indices])
        if capture is not None:
            capture.features = kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over final-norm hidden states (an EAGLE-1 head reuses it)."""
        if self.lm_head is None:
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)

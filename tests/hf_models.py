"""Random-initialised Hugging Face checkpoints built inside the tests (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def make_config(arch: str, **overrides: Any):
    import transformers

    kinds = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "qwen3": "Qwen3Config",
             "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config"}
    # transformers' own defaults for these are Gemma's 256 (head_dim, scalar) and Phi-3's
    # 32000 (pad, outside BASE's vocabulary): sized to BASE unless a test says otherwise
    gemma = dict(head_dim=16, query_pre_attn_scalar=16)
    sized = {"gemma2": gemma, "gemma3": gemma, "qwen3": dict(head_dim=16), "phi3": dict(pad_token_id=0)}
    return getattr(transformers, kinds[arch])(**{**BASE, **sized.get(arch, {}), **overrides})


def perturb_norms(model, seed: int, scale: float = 0.3) -> None:
    """Random RMSNorm weights (transformers initialises them to ones, or Gemma's zeros):
    a norm whose form or place is wrong then shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen).to(param.dtype) * scale)


def build_model(path: Path, arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                qk_gain: float = 1.0, **overrides: Any):
    """Save a random model in HF format to `path`; returns the HF model (eval mode).
    `qk_gain` scales the q and k projections: attention scores large enough for a
    soft-cap to bite (random init's are ~0.03)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(arch, **overrides)
    # eager: transformers' reference attention (its SDPA path has no soft-capping)
    extra = {"attn_implementation": "eager"} if arch.startswith("gemma") else {}
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra).eval()
    if arch not in ("llama", "qwen2", "mistral"):  # the older kinds' tests keep their weights
        perturb_norms(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if qk_gain != 1.0 and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(qk_gain)
    model.generation_config.pad_token_id = config.eos_token_id
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: bool = True) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=model.config.eos_token_id if eos else None,
        )
    return out[0, len(prompt) :].tolist()


def build_beam_model(path: Path, vocab_size: int, seed: int, eos_at: int):
    """A small-vocabulary model whose EOS is a token greedy decoding really produces
    (greedy token `eos_at` after the prompt [5, 6, 7, 8] of 8), so beams finish early as
    well as at max length. Returns (HF model reloaded with that EOS, eos, greedy tokens)."""
    from transformers import AutoModelForCausalLM

    model = build_model(path, "llama", vocab_size=vocab_size, seed=seed)
    ids = torch.tensor([[5, 6, 7, 8]])
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
    eos = greedy[eos_at]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = eos
        (path / name).write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(path).eval(), eos, greedy

"""Which architectures pdserve runs: config.json's `architectures` name -> a family.

A family is the model class that computes it (imported lazily: the router reads
this table without torch) and the few facts `ModelConfig.from_hf_config` needs to
read its config.json the way transformers does. Adding a family is its model file
plus one line in FAMILIES; an architecture that is not here is refused, naming the
ones that are.

    architectures[i] ──FAMILIES──> Family(model="module:Class", traits...)
                                          │
               loader.build_model ────────┘ model_class(cfg.architecture)(cfg, ropes)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# HF name suffix -> (our parameter suffix, index of the shard inside a fused weight):
# q/k/v and gate/up go into row ranges of one matmul each. A checkpoint that is fused
# already (Phi-3's qkv_proj, gate_up_proj) matches none of these and loads whole.
FUSED_WEIGHTS: Mapping[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


@dataclass(frozen=True)
class Family:
    """How one architecture is built and how its config.json reads.

        model           "module:Class" of the forward pass
        qkv_bias        q/k/v carry a bias whatever attention_bias says, o_proj none (Qwen2)
        sliding         how layers get a sliding window from `sliding_window`:
                          "never"    ignored (Llama)
                          "flag"     only with use_sliding_window (Qwen2, Qwen3)
                          "all"      every layer unless layer_types says otherwise
                          "pattern"  layer_types, else every `sliding_pattern`-th layer
                                     is global (Gemma 2: 2; Gemma 3: config's
                                     sliding_window_pattern, default 6)
        qk_norm         per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
        attn_softcap    attention applies attn_logit_softcapping (Gemma 2; transformers'
                        Gemma 3 does not pass it to attention, so neither do we)
        local_rope      sliding layers have their own RoPE (Gemma 3's local base)
        defaults        config.json keys the family's transformers config class fills in
                        when absent (a file written by transformers 4 leaves out those
                        equal to the base class's, tie_word_embeddings=true among them)
    """

    model: str
    qkv_bias: bool = False
    sliding: str = "all"
    sliding_pattern: int = 2
    qk_norm: bool = False
    attn_softcap: bool = False
    local_rope: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    weights: Mapping[str, tuple[str, int]] = field(default_factory=lambda: FUSED_WEIGHTS)


_LLAMA = "pdserve.engine.model.llama:LlamaForCausalLM"
_GEMMA = "pdserve.engine.model.gemma:GemmaForCausalLM"
# Gemma2Config's and Gemma3TextConfig's defaults for the keys pdserve reads
_GEMMA_DEFAULTS = dict(tie_word_embeddings=True, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                       head_dim=256, sliding_window=4096, rms_norm_eps=1e-6)

FAMILIES: Mapping[str, Family] = {
    "LlamaForCausalLM": Family(_LLAMA, sliding="never"),
    "MistralForCausalLM": Family(_LLAMA),
    "Qwen2ForCausalLM": Family(_LLAMA, qkv_bias=True, sliding="flag"),
    "Qwen3ForCausalLM": Family(_LLAMA, sliding="flag", qk_norm=True),
    "Phi3ForCausalLM": Family(_LLAMA),
    "Gemma2ForCausalLM": Family(_GEMMA, sliding="pattern", attn_softcap=True, defaults=dict(
        _GEMMA_DEFAULTS, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192)),
    "Gemma3ForCausalLM": Family(_GEMMA, sliding="pattern", sliding_pattern=6, qk_norm=True, local_rope=True,
                                defaults=dict(_GEMMA_DEFAULTS, max_position_embeddings=131072)),
}

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def resolve_architecture(architectures: list[str]) -> str:
    """The first of config.json's `architectures` pdserve runs; ValueError naming them
    and listing the supported ones otherwise."""
    arch = next((a for a in architectures if a in FAMILIES), None)
    if arch is None:
        raise ValueError(f"architectures: {architectures} not supported; pdserve runs {', '.join(FAMILIES)}")
    return arch


def family(architecture: str) -> Family:
    return FAMILIES[resolve_architecture([architecture])]


def model_class(architecture: str) -> Any:
    module, _, name = family(architecture).model.partition(":")
    return getattr(importlib.import_module(module), name)

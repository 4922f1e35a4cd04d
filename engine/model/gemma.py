"""Gemma 2 and Gemma 3 (text) over a paged KV cache, in step with transformers'.

What differs from the Llama decoder, each as transformers computes it:

    embeddings      scaled by sqrt(hidden_size), the scale rounded to the model dtype
    RMSNorm         x_norm * (1 + weight), all in float32, cast back last
    layer           input_norm -> attention -> post_attention_norm -> + residual
                    pre_feedforward_norm -> GeGLU MLP -> post_feedforward_norm -> + residual
    attention       scale query_pre_attn_scalar^-1/2; Gemma 2: scores soft-capped
                    (tanh(s / cap) * cap) before the mask; Gemma 3: per-head q/k norm
                    before RoPE, no soft-cap; sliding layers alternate with global ones
                    (Gemma 3's sliding layers have their own RoPE base)
    logits          soft-capped by final_logit_softcapping
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.llama import MLP, Attention, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Attention(cfg, layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, h, rotary, kv, meta, backend):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rotary, kv, meta, backend))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap, in x's dtype (transformers' op order); x itself for None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


class GemmaForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weights' dtype
        return h * torch.tensor(self.cfg.hidden_size**0.5, dtype=torch.float32).to(h.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return softcap(super().logits(h), self.cfg.final_logit_softcapping)

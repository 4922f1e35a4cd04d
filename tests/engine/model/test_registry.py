"""The model registry and how each family's config.json reads: refusals name what is
wrong and list what is supported; older spellings read as transformers reads them."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.engine.config import SUPPORTED_ROPE_TYPES, ModelConfig
from pdserve.engine.model import registry
from hf_models import make_config


ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "llama": "LlamaForCausalLM"}


def hf_dict(arch: str, **overrides) -> dict:
    """config.json as transformers writes it for a model of this config."""
    cfg = json.loads(make_config(arch, **overrides).to_json_string())
    return {**cfg, "architectures": [ARCHITECTURES[arch]]}


def test_every_family_resolves_to_a_model_class():
    for arch in registry.SUPPORTED_ARCHITECTURES:
        assert registry.model_class(arch).__name__.endswith("ForCausalLM")


def test_unknown_architecture_is_refused_listing_the_supported():
    cfg = hf_dict("llama")
    cfg["architectures"] = ["FalconForCausalLM"]
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(cfg)
    assert "FalconForCausalLM" in str(err.value)
    assert all(a in str(err.value) for a in registry.SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_unsupported_rope_type_is_refused_listing_the_supported(arch):
    cfg = hf_dict(arch)
    if arch == "gemma3":
        cfg["rope_parameters"]["full_attention"] = {"rope_type": "mrope", "rope_theta": 1e6}
    else:
        cfg["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 1e4}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(cfg)
    assert "'mrope'" in str(err.value) and "rope_type" in str(err.value)
    assert all(t in str(err.value) for t in SUPPORTED_ROPE_TYPES)


def test_unsupported_activation_and_bidirectional_attention_are_refused():
    with pytest.raises(ValueError, match="hidden_act: 'relu'"):
        ModelConfig.from_hf_config({**hf_dict("llama"), "hidden_act": "relu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config({**hf_dict("gemma3"), "use_bidirectional_attention": True})


def test_gemma3_transformers4_spelling_and_window_pattern():
    """rope_theta (global) + rope_local_base_freq + rope_scaling (global only), and no
    layer_types: every sliding_window_pattern-th layer is global."""
    cfg = {**hf_dict("gemma3", num_hidden_layers=6), "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3}
    del cfg["rope_parameters"], cfg["layer_types"]
    model = ModelConfig.from_hf_config(cfg)
    assert (model.rope.theta, model.rope.rope_type, model.rope.factor) == (1e6, "linear", 8.0)
    assert model.rope_local is not None
    assert (model.rope_local.theta, model.rope_local.rope_type) == (10000.0, "default")
    window = cfg["sliding_window"]
    assert model.sliding_windows == (window, window, None, window, window, None)
    assert model.qk_norm and model.attn_logit_softcapping is None


def test_gemma2_reads_softcaps_and_scalar():
    model = ModelConfig.from_hf_config(hf_dict("gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                               query_pre_attn_scalar=24))
    assert (model.attn_logit_softcapping, model.final_logit_softcapping) == (50.0, 30.0)
    assert model.query_pre_attn_scalar == 24.0 and model.hidden_act == "gelu_pytorch_tanh"
    assert model.sliding_windows[0] is not None and model.sliding_windows[1] is None


def test_phi3_longrope_factors_and_attention_factor():
    """A top-level original_max_position_embeddings wins (transformers' rule for Phi-3);
    the attention factor is sqrt(1 + ln(max / original) / ln(original))."""
    factors = [1.0] * 8
    cfg = hf_dict("phi3", head_dim=16, max_position_embeddings=1024, original_max_position_embeddings=64,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": factors,
                                   "long_factor": [2.0] * 8})
    cfg["rope_parameters"]["original_max_position_embeddings"] = 4096
    rope = ModelConfig.from_hf_config(cfg).rope
    assert rope.original_max_position_embeddings == 64 and rope.long_factor == (2.0,) * 8
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(16) / math.log(64)))
    del cfg["rope_parameters"]["short_factor"]
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig.from_hf_config(cfg)


def test_qwen3_head_dim_is_its_own():
    model = ModelConfig.from_hf_config(hf_dict("qwen3", head_dim=40))
    assert model.head_dim == 40 and model.q_size == 160 and model.qk_norm and not model.qkv_bias


def test_gemma_defaults_fill_keys_a_transformers4_file_leaves_out():
    """transformers 4 writes only what differs from the base config: a tied Gemma 2
    has no tie_word_embeddings key, and Gemma2Config's defaults apply."""
    cfg = hf_dict("gemma2")
    for key in ("tie_word_embeddings", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        del cfg[key]
    model = ModelConfig.from_hf_config(cfg)
    assert model.tie_word_embeddings and model.query_pre_attn_scalar == 256
    assert (model.attn_logit_softcapping, model.final_logit_softcapping) == (50.0, 30.0)
    cfg["final_logit_softcapping"] = None  # an explicit null stays off
    assert ModelConfig.from_hf_config(cfg).final_logit_softcapping is None

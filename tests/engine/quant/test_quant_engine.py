"""Quantized weights and an FP8 KV cache through the whole engine."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.base import round_trip_kv
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.memory import plan_memory
from pdserve.engine.prepacked import packed_bytes
from pdserve.engine.quant.linear import QuantLinear
from hf_models import build_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43, 44], [3] * 37]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_model(path, "llama", hidden_size=128, intermediate_size=256, tie_word_embeddings=False)
    return str(path)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([list(p) for p in prompts], params)]


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "fp8", "fp4"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_plan_equals_what_the_engine_allocated(quantization, kv_cache_dtype):
    kwargs = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_model_len=512)
    llm = LLM(DEFAULT_MODEL, kv_cache_memory=3 << 20, **kwargs)
    plan = plan_memory(DEFAULT_MODEL, kv_cache_memory=3 << 20, **kwargs)
    assert plan == llm.engine.memory
    model = llm.engine.runner.model  # prepacked layers hold their weights outside the parameters
    fbgemm = sum(m.packed_nbytes for m in model.modules() if isinstance(m, QuantLinear))  # W8A8 (cpu_int8.py)
    assert plan.weight_bytes == packed_bytes(model) + fbgemm + sum(t.numel() * t.element_size() for t in {
        t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}.values())


def test_fp8_kv_holds_four_times_the_blocks_of_fp32_and_quantized_weights_shrink():
    full = plan_memory(DEFAULT_MODEL, kv_cache_memory=64 << 20)
    fp8 = plan_memory(DEFAULT_MODEL, kv_cache_memory=64 << 20, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token * 4 == full.kv_bytes_per_token
    assert fp8.num_blocks == 4 * full.num_blocks
    int8 = plan_memory(DEFAULT_MODEL, quantization="int8")
    assert full.weight_bytes / int8.weight_bytes > 3.9  # the LM head and tied table are int8 too
    assert plan_memory(DEFAULT_MODEL, quantization="int4").weight_bytes < plan_memory(
        DEFAULT_MODEL, quantization="fp8").weight_bytes < full.weight_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_output_does_not_depend_on_caching_chunking_or_preemption(llama, kv_cache_dtype):
    """Attention always reads K/V as the cache holds them, a fresh prompt's too."""
    base = tokens(LLM(llama, kv_cache_dtype=kv_cache_dtype, num_blocks=64))
    for mode in (dict(enable_prefix_caching=False), dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),
                 dict(num_blocks=6, max_num_batched_tokens=64)):
        llm = LLM(llama, kv_cache_dtype=kv_cache_dtype, **{"num_blocks": 64, **mode})
        assert tokens(llm) == base, mode
    llm = LLM(llama, kv_cache_dtype=kv_cache_dtype, num_blocks=64)
    tokens(llm, PROMPTS[:1])  # the first prompt's blocks are now cached
    assert tokens(llm) == base
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, {"fp8_e4m3": "float8_e4m3fn"}.get(
        kv_cache_dtype, "float8_e5m2"))


def test_fp8_kv_cache_holds_the_quantized_k_and_v(llama):
    llm = LLM(llama, kv_cache_dtype="fp8", num_blocks=16, enable_prefix_caching=False)
    prompt = list(range(3, 3 + 16))
    llm.generate([prompt], SamplingParams(max_tokens=1))
    ref = LLM(llama, num_blocks=16, enable_prefix_caching=False)
    ref.generate([prompt], SamplingParams(max_tokens=1))
    # block 0 of every layer: the fp32 cache's K/V, quantized the same way, are the fp8 bytes
    fp8 = llm.engine.runner.kv_cache[:, 0]
    want = round_trip_kv(ref.engine.runner.kv_cache[:, 0], 1.0, torch.float8_e4m3fn)
    # the layers differ once attention reads quantized K/V, layer 0's input does not
    assert torch.equal(fp8[0].float(), want[0])
    assert (fp8[1:].float() - want[1:]).abs().max() < 0.25


def test_checkpoint_kv_scales_are_used_and_bad_ones_refused(tmp_path, caplog):
    build_model(tmp_path, "llama", hidden_size=64, num_hidden_layers=2)
    with caplog.at_level(logging.WARNING):
        LLM(str(tmp_path), kv_cache_dtype="fp8", num_blocks=8)
    assert "no k_scale/v_scale for 2 of 2 layers" in caplog.text
    tensors = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        # an older compressed-tensors name for the same scale
        tensors[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor([0.25])
    save_file(tensors, tmp_path / "model.safetensors")
    llm = LLM(str(tmp_path), kv_cache_dtype="fp8", num_blocks=8)
    assert [layer.self_attn.kv_scales for layer in llm.engine.runner.model.layers] == [(0.5, 0.25), (1.5, 0.25)]
    assert llm.engine.runner.kv_format != LLM(str(tmp_path), kv_cache_dtype="fp8", num_blocks=8,
                                              quantization="int8").engine.runner.kv_format
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([-1.0])
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers.1.self_attn.v_scale must be a positive finite number"):
        LLM(str(tmp_path), kv_cache_dtype="fp8", num_blocks=8)


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 24})])
@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8", "fp4"])
def test_every_scheme_serves_forks_beams_and_logprobs(tmp_path, arch, extra, quantization):
    build_model(tmp_path, arch, hidden_size=128, intermediate_size=256, **extra)
    llm = LLM(str(tmp_path), quantization=quantization, kv_cache_dtype="fp8", num_blocks=64)
    out = llm.generate([PROMPTS[0]], [
        SamplingParams(max_tokens=6, min_tokens=6, n=3, temperature=0.9, seed=1, logprobs=2, prompt_logprobs=1)])[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in out.outputs)
    beams = llm.generate([PROMPTS[1]], [SamplingParams(max_tokens=5, beam_width=3, n=2)])[0]
    assert len(beams.outputs) == 2
    llm.engine.check_integrity()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_quantization_names_are_checked():
    with pytest.raises(ValueError, match="quantization: unknown 'int3'"):
        LLM(DEFAULT_MODEL, quantization="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown 'fp16'"):
        LLM(DEFAULT_MODEL, kv_cache_dtype="fp16")


def test_a_quantization_config_the_engine_cannot_serve_is_refused(tmp_path):
    build_model(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bitsandbytes"):
        LLM(str(tmp_path), num_blocks=8)

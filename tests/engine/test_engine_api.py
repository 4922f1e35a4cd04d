"""The engine's public surface: validation, abort, stats, running out of blocks."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.config import CacheConfig
from hf_models import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_model(path, "llama")
    return str(path)


def test_bad_input_names_the_field(model_dir):
    llm = LLM(model=model_dir, max_model_len=128)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5] * 120], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[5, 999]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=model_dir, max_model_len=4096)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=model_dir, block_size=12)


def test_abort_mid_generation_frees_every_block(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=64)))
    for i in range(4):
        engine.add_request(f"r{i}", list(range(3, 3 + 40 + i)), SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(5):
        engine.step()
    assert engine.stats().num_free_blocks < 64
    for i in range(4):
        engine.abort(f"r{i}")
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.stats().num_free_blocks == 64


def test_request_too_big_for_the_pool_fails_instead_of_hanging(model_dir):
    llm = LLM(model=model_dir, num_blocks=4, block_size=16)
    outs = llm.generate([[5] * 100, [6] * 10], SamplingParams(max_tokens=4, temperature=0.0))
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
    llm.check_integrity()
    assert llm.stats().num_free_blocks == 4


def test_stats_and_outputs_in_prompt_order(model_dir):
    llm = LLM(model=model_dir)
    prompts = [[3 + i] * (5 + 17 * i) for i in range(5)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=1 + i, temperature=0.0) for i in range(5)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
    assert [o.prompt_token_ids for o in outs] == prompts
    stats = llm.stats()
    for key in ("num_blocks", "num_free_blocks", "prefix_cache_queries", "prefix_cache_hits"):
        assert hasattr(stats, key)
    assert stats.num_free_blocks == stats.num_blocks


def test_stop_token_and_eos(model_dir):
    llm = LLM(model=model_dir)
    prompt = [[7, 8, 9, 10]]
    free_run = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    tokens = free_run.outputs[0].token_ids
    stop = tokens[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == tokens[: tokens.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_triton_backend_matches_transformers(model_dir):
    """The whole engine on the Triton kernels (interpreter on a CPU) against HF greedy."""
    from transformers import AutoModelForCausalLM

    from hf_models import hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[3 + i for i in range(n)] for n in (1, 5, 21, 40)]
    llm = LLM(model=model_dir, attention_backend="triton", max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    llm.check_integrity()

"""The captured decode step (engine/captured.py): the same tokens as the eager path and
as transformers, on every family the tests build, through sampling, n > 1, beams,
logprobs, prefix caching, preemption and a float8 KV cache; steps that do not fit a
bucket run eagerly. Each engine here compiles its buckets (seconds each), so the
models are small and the buckets few."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.captured import available
from pdserve.engine.config import EngineConfig, parse_capture_sizes
from pdserve.engine.memory import plan_memory
from hf_models import build_model, hf_greedy

pytestmark = pytest.mark.skipif(not available(torch.device("cpu"), False), reason="CPU capture unavailable")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
# every family and feature test_prepacked.py builds, small: a window of 12 tokens bites
CONFIGS = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-mqa": ("llama", dict(tie_word_embeddings=False, num_key_value_heads=1)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral-sliding": ("mistral", dict(sliding_window=12)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    "gemma2-softcap-sliding": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3-local-global": ("gemma3", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                                           layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(tie_word_embeddings=False)),
}
# the sampling / beams / preemption test on four of them (each engine compiles its buckets)
SAMPLED = ("llama-tied", "qwen3-qk-norm", "gemma2-softcap-sliding", "phi3")
SIZES = (4,)  # a batch of 1-4 runs padded to 4: padding is exercised by every test
MAX_NEW = 10


def prompts(seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 20, 33, 5, 40)]
    out.append(out[3][:32] + [rng.randrange(3, vocab) for _ in range(6)])  # shares two blocks with prompt 3
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (path, prompts, transformers' greedy tokens), each built once."""
    built: dict[str, tuple[str, list[list[int]], list[list[int]]]] = {}

    def get(name: str):
        if name not in built:
            arch, overrides = CONFIGS[name]
            path = tmp_path_factory.mktemp(name)
            hf = build_model(path, arch, seed=5, **{**SMALL, **overrides})
            ps = prompts()
            built[name] = (str(path), ps, [hf_greedy(hf, p, MAX_NEW) for p in ps])
        return built[name]

    return get


@pytest.fixture(params=list(CONFIGS))
def model(request, models):
    return models(request.param)


@pytest.fixture(params=SAMPLED)
def sampled(request, models):
    return models(request.param)


def pair(path: str, sizes=SIZES, **kwargs) -> tuple[LLM, LLM]:
    captured = LLM(model=path, decode_capture_sizes=sizes, block_size=16, **kwargs)
    eager = LLM(model=path, enforce_eager=True, block_size=16, **kwargs)
    assert captured.engine.runner.captured is not None and eager.engine.runner.captured is None
    return captured, eager


def tokens(llm: LLM, ps, params) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(ps, params)]


def test_greedy_captured_equals_eager_and_transformers(model):
    path, ps, expected = model
    captured, eager = pair(path, num_blocks=12, max_num_batched_tokens=256)  # as the sampling test: their graphs are one
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    graphs = captured.engine.runner.captured
    # one prompt (batch 1 in bucket 4), four together, then all seven: beyond the
    # bucket, so those steps run eagerly (until sequences finish, if any does early)
    for group in ([ps[0]], ps[1:5], ps):
        before = graphs.steps
        got, want = tokens(captured, group, params), tokens(eager, group, params)
        assert got == want
        assert graphs.steps > before or len(group) > max(SIZES)
    for i, (out, exp) in enumerate(zip(tokens(captured, ps, params), expected)):
        assert out[0] == exp, f"prompt {i} diverged from transformers"
    for llm in (captured, eager):
        llm.check_integrity()
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_sampling_n_beams_logprobs_prefix_cache_and_preemption(sampled):
    path, ps, _ = sampled
    captured, eager = pair(path, num_blocks=12, max_num_batched_tokens=256)  # 12 blocks: preempts
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=7, n=2, ignore_eos=True)
    assert tokens(captured, ps[:4], seeded) == tokens(eager, ps[:4], seeded)
    beams = SamplingParams(max_tokens=6, temperature=0.0, beam_width=2, n=2, ignore_eos=True)
    assert tokens(captured, ps[1:3], beams) == tokens(eager, ps[1:3], beams)
    logprobs = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
    for x, y in zip(captured.generate(ps[2:4], logprobs), eager.generate(ps[2:4], logprobs)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for sa, sb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert sa.keys() == sb.keys()
            assert list(sa.values()) == pytest.approx(list(sb.values()), abs=1e-4)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    assert tokens(captured, [ps[3], ps[6], ps[5]], long) == tokens(eager, [ps[3], ps[6], ps[5]], long)
    assert captured.stats().num_preemptions > 0
    assert captured.engine.runner.captured.steps > 0
    for llm in (captured, eager):
        llm.check_integrity()
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_fp8_kv_cache_and_several_buckets(tmp_path):
    build_model(tmp_path, "llama", seed=2, **SMALL)
    ps = prompts(1)
    captured, eager = pair(str(tmp_path), sizes=(1, 2, 4), num_blocks=64, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for group in (ps[:1], ps[:2], ps[:3]):
        assert tokens(captured, group, params) == tokens(eager, group, params)
    assert sorted(captured.engine.runner.captured.buckets) == [1, 2, 4]


def test_graphs_share_the_eager_paths_weights(tmp_path):
    """The plan and the weights held are the fast path's: no bucket copies a weight."""
    build_model(tmp_path, "llama", seed=2, **{**SMALL, "hidden_size": 512, "intermediate_size": 1024,
                                              "num_attention_heads": 8})  # big enough to prepack
    captured = LLM(model=str(tmp_path), decode_capture_sizes="1,2", num_blocks=16)
    fast = LLM(model=str(tmp_path), num_blocks=16)
    assert captured.engine.runner.prepacked == fast.engine.runner.prepacked > 0
    assert captured.engine.memory == fast.engine.memory == plan_memory(str(tmp_path), num_blocks=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ps = prompts(3)[:2]
    assert tokens(captured, ps, params) == tokens(fast, ps, params)
    assert captured.engine.runner.captured.steps > 0


def test_enforce_eager_and_quantized_weights_capture_nothing(tmp_path):
    build_model(tmp_path, "llama", seed=2, **SMALL)
    assert LLM(model=str(tmp_path), decode_capture_sizes=(4,), enforce_eager=True).engine.runner.captured is None
    assert LLM(model=str(tmp_path), decode_capture_sizes=(4,), quantization="int8").engine.runner.captured is None


@pytest.mark.parametrize("text, sizes", [("", ()), ("4, 1,4", (1, 4)), ((16, 2), (2, 16))])
def test_capture_sizes_parse(text, sizes):
    assert parse_capture_sizes(text) == sizes


@pytest.mark.parametrize("bad", ["1,x", "0", "2000", (-1,)])
def test_bad_capture_sizes_name_the_field(bad):
    with pytest.raises(ValueError, match="decode_capture_sizes"):
        EngineConfig(model="m", decode_capture_sizes=bad)

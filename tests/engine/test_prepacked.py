"""The fast path's oneDNN-prepacked linear layers (engine/prepacked.py): the same
numbers as F.linear to rounding, and the same tokens as the eager path and as
transformers through everything the engine does, on a model of every family large
enough to pack."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.prepacked import (MAX_CHUNK_ROWS, MIN_PACKED_WEIGHTS, PrepackedLinear, available, bucket_rows,
                                      prepack_linears)
from hf_models import build_model, hf_greedy

pytestmark = pytest.mark.skipif(not available(torch.device("cpu"), torch.float32), reason="no oneDNN on this CPU")

# hidden 512: every projection and the LM head has >= 256K weights, so all of them pack
PACKABLE = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=512)
CONFIGS = {
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied-mqa": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral-sliding": ("mistral", dict(sliding_window=40)),
    "qwen3": ("qwen3", dict(head_dim=64, tie_word_embeddings=False)),
    "gemma2-softcap-sliding": ("gemma2", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=40,
                                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3-local-global": ("gemma3", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=40,
                                           layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(tie_word_embeddings=False)),
}
MODES = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=64, long_prefill_token_threshold=24),
    "preempt": dict(num_blocks=10, max_num_batched_tokens=512),
}
MAX_NEW = 12


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 17, 65, 100, MAX_CHUNK_ROWS, MAX_CHUNK_ROWS + 1, 1200])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(384, 256, generator=gen)
    b = torch.randn(384, generator=gen) if bias else None
    x = torch.randn(rows, 256, generator=gen)
    layer = PrepackedLinear(weight, b)
    got = layer(x)
    assert got.shape == (rows, 384)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 5, 256, generator=gen)
    torch.testing.assert_close(layer(x3), F.linear(x3, weight, b), rtol=1e-5, atol=1e-4)
    # a view whose rows are not contiguous (the model splits fused outputs)
    wide = torch.randn(3, 512, generator=gen)[:, :256]
    torch.testing.assert_close(layer(wide), F.linear(wide, weight, b), rtol=1e-5, atol=1e-4)


def test_row_counts_reach_onednn_as_a_few_buckets():
    """oneDNN's memory grows with every distinct row count it sees (a prefill worker sees
    every prompt length): 1..MAX_CHUNK_ROWS rows map onto at most 20 padded counts."""
    buckets = {bucket_rows(rows) for rows in range(1, MAX_CHUNK_ROWS + 1)}
    assert all(rows <= bucket_rows(rows) for rows in range(1, MAX_CHUNK_ROWS + 1))
    assert bucket_rows(1) == 4 and bucket_rows(16) == 16 and bucket_rows(17) == 32 and bucket_rows(65) == 96
    assert len(buckets) <= 20 and max(buckets) == MAX_CHUNK_ROWS


@pytest.mark.skipif(not available(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN packs no bf16")
def test_bf16_prepacked_matches_f_linear():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(512, 512, generator=gen).bfloat16()
    x = torch.randn(4, 512, generator=gen).bfloat16()
    torch.testing.assert_close(PrepackedLinear(weight, None)(x).float(), F.linear(x, weight).float(),
                               rtol=1e-2, atol=1e-1)


def test_a_bf16_engine_runs_on_every_cpu_packing_only_where_onednn_has_a_bf16_path(tmp_path):
    """An AVX2-only CPU's oneDNN refuses to pack bf16 weights: such an engine keeps
    plain linears instead of failing to load."""
    build_model(tmp_path, "llama", seed=3, **PACKABLE)
    bf16 = LLM(model=str(tmp_path), dtype="bfloat16", num_blocks=32)
    packs = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (bf16.engine.runner.prepacked > 0) == packs
    out = bf16.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert not available(torch.device("cpu"), torch.float16)


def test_only_large_plain_linears_are_packed():
    big = nn.Linear(512, 512, bias=False)
    model = nn.ModuleDict({"big": big, "small": nn.Linear(64, 64), "other": nn.LayerNorm(8)})
    tied = torch.randn(1024, 512)
    assert prepack_linears(model, tied) == 2
    assert isinstance(model["big"], PrepackedLinear) and type(model["small"]) is nn.Linear
    assert isinstance(model.lm_head, PrepackedLinear)  # the tied head's own packed copy
    assert model["big"].nbytes == 512 * 512 * 4
    small_table = torch.randn(MIN_PACKED_WEIGHTS // 512 - 1, 512)
    assert prepack_linears(nn.ModuleDict({"x": nn.Linear(8, 8)}), small_table) == 0


def test_prepacked_layer_rejects_a_non_matrix():
    with pytest.raises(ValueError, match="weight must be 2-D"):
        PrepackedLinear(torch.randn(4), None)


def prompts(seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 33, 70, 120)]
    out.append(out[4][:64] + [rng.randrange(3, vocab) for _ in range(8)])  # a shared prefix
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = build_model(path, arch, seed=3, **{**PACKABLE, **overrides})
    ps = prompts()
    return str(path), ps, [hf_greedy(hf, p, MAX_NEW) for p in ps]


def pair(path: str, **kwargs) -> tuple[LLM, LLM]:
    fast, eager = LLM(model=path, **kwargs), LLM(model=path, enforce_eager=True, **kwargs)
    assert fast.engine.runner.prepacked > 0 and eager.engine.runner.prepacked == 0
    return fast, eager


def tokens(llm: LLM, ps, params) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(ps, params)]


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_fast_equals_eager_and_transformers(model, mode):
    path, ps, expected = model
    fast, eager = pair(path, **MODES[mode])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got_fast, got_eager = tokens(fast, ps, params), tokens(eager, ps, params)
    assert got_fast == got_eager
    for i, (out, exp) in enumerate(zip(got_fast, expected)):
        assert out[0][: len(exp)] == exp, f"prompt {i} (len {len(ps[i])}) diverged from transformers"
    if mode == "preempt":
        assert fast.stats().num_preemptions > 0
    for llm in (fast, eager):
        llm.check_integrity()
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_sampling_n_beams_and_logprobs_fast_equals_eager(model):
    path, ps, _ = model
    fast, eager = pair(path)
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=7, n=2, ignore_eos=True)
    assert tokens(fast, ps, seeded) == tokens(eager, ps, seeded)
    beams = SamplingParams(max_tokens=6, temperature=0.0, beam_width=3, n=2, ignore_eos=True)
    assert tokens(fast, ps[:3], beams) == tokens(eager, ps[:3], beams)
    logprobs = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
    a, b = fast.generate(ps[2:4], logprobs), eager.generate(ps[2:4], logprobs)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for pa, pb in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            assert list(pa.values()) == pytest.approx(list(pb.values()), abs=1e-4)
        for sa, sb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert sa.keys() == sb.keys()
    # the weights' bytes do not depend on the layout (a tied head's packed copy aside)
    extra = 0 if fast.engine.model_config.tie_word_embeddings is False else 512 * 512 * 4
    assert fast.engine.runner.weight_bytes == eager.engine.runner.weight_bytes + extra

"""Token-exact agreement with Hugging Face transformers on the same random weights."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from hf_models import build_model, hf_greedy

MAX_NEW = 24

CONFIGS = {
    "llama-gqa-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied-llama3-rope": (
        "llama",
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=1,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-mha-bias-headdim": ("llama", dict(num_key_value_heads=4, attention_bias=True, head_dim=24)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral-sliding": ("mistral", dict(sliding_window=48)),
}

MODES = {
    "default": {},
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=64, long_prefill_token_threshold=24),
    "preempt": dict(num_blocks=24, max_num_batched_tokens=512),
}


def mixed_prompts(seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Lengths 1..300, two of them sharing a long prefix."""
    rng = random.Random(seed)
    lengths = [1, 7, 16, 33, 120, 300, 64, 250]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    prompts.append(prompts[5][:200] + [rng.randrange(3, vocab) for _ in range(20)])
    return prompts


@pytest.fixture(scope="module", params=list(CONFIGS))
def reference(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = build_model(path, arch, **overrides)
    prompts = mixed_prompts()
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return path, prompts, expected


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(reference, mode):
    path, prompts, expected = reference
    llm = LLM(model=str(path), **MODES[mode])
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) diverged"
    if mode == "preempt":
        assert llm.stats().num_preemptions > 0
    llm.check_integrity()
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_second_run_hits_prefix_cache(reference):
    path, prompts, expected = reference
    llm = LLM(model=str(path))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    hits_before = llm.stats().prefix_cache_hits
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.stats()
    assert first == second == expected
    assert stats.prefix_cache_hits > hits_before
    # Every prompt of at least two blocks hits all but its last partial/last token.
    assert stats.prefix_cache_hits - hits_before >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    llm.check_integrity()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_first_token(tmp_path, dtype):
    """Half precision runs and agrees with HF on the first token wherever HF's top-2 gap is clear."""
    torch_dtype = getattr(torch, dtype)
    model = build_model(tmp_path, "llama", dtype=torch_dtype)
    prompts = mixed_prompts(1)
    llm = LLM(model=str(tmp_path), dtype=dtype)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    checked = 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1].float()
        top2 = logits.topk(2).values
        if top2[0] - top2[1] > 0.05 * top2[0].abs().clamp(min=1.0):
            assert out.outputs[0].token_ids[0] == int(logits.argmax())
            checked += 1
    assert checked >= len(prompts) // 2
    llm.check_integrity()

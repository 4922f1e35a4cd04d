"""Parallel sampling, beam search, seeds and logprobs through the whole engine."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from hf_models import build_beam_model, build_model

VOCAB = 64


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory):
    """A small-vocabulary model whose EOS is a token greedy decoding really produces,
    so beams finish early as well as at max length."""
    path = tmp_path_factory.mktemp("beam")
    model, eos, _ = build_beam_model(path, VOCAB, seed=3, eos_at=5)
    return path, model, eos


def hf_beams(model, prompt, k, n, max_new, length_penalty, early_stopping, eos):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=n, do_sample=False,
        max_new_tokens=max_new, length_penalty=length_penalty, early_stopping=early_stopping,
        pad_token_id=eos,
    )
    beams = []
    for row in out[:, len(prompt):].tolist():
        beams.append(row[: row.index(eos) + 1] if eos in row else row)
    return beams


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.6, True), (2.0, "never")])
def test_beam_search_matches_transformers(beam_model, k, length_penalty, early_stopping):
    path, model, eos = beam_model
    rng = random.Random(k)
    prompts = [[5, 6, 7, 8]] + [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 19, 70)]
    n = min(3, k)
    llm = LLM(model=str(path))
    params = SamplingParams(
        max_tokens=10, beam_width=k, n=n, length_penalty=length_penalty, early_stopping=early_stopping, temperature=0.0
    )
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        expected = hf_beams(model, prompt, k, n, 10, length_penalty, early_stopping, eos)
        assert [c.token_ids for c in out.outputs] == expected, f"prompt of {len(prompt)} tokens"
    llm.check_integrity()
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_some_beams_end_on_eos(beam_model):
    path, _, eos = beam_model
    out = LLM(model=str(path)).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=10, beam_width=4, n=4))[0]
    assert any(c.token_ids[-1] == eos for c in out.outputs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen")
    build_model(path, "llama", seed=5)
    return str(path)


def test_seeded_sampling_is_reproducible_and_batch_independent(model_dir):
    llm = LLM(model=model_dir)
    prompt = [3, 9, 27, 81, 243 % 256]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    rng = random.Random(1)
    companions = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    mixed = llm.generate(
        companions[:3] + [prompt] + companions[3:],
        [SamplingParams(max_tokens=20, temperature=0.8)] * 3 + [params] + [SamplingParams(max_tokens=5, temperature=1.2)] * 3,
    )
    assert mixed[3].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert other_seed[0].outputs[0].token_ids != alone
    llm.check_integrity()


def test_n_samples_differ_and_are_seeded(model_dir):
    llm = LLM(model=model_dir)
    params = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=7)
    first = [c.token_ids for c in llm.generate([[4, 5, 6]], params)[0].outputs]
    again = [c.token_ids for c in llm.generate([[4, 5, 6]], params)[0].outputs]
    assert first == again and len(first) == 4 and len({tuple(t) for t in first}) > 1
    llm.check_integrity()


def _peak_blocks(engine: LLMEngine) -> int:
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.stats().num_blocks - engine.stats().num_free_blocks)
    return peak


def test_parallel_samples_share_the_prompt_blocks(model_dir):
    """n=8 over a 512-token prompt stores the prompt's 32 blocks once."""
    prompt = [3 + (i * 7) % 250 for i in range(512)]
    max_tokens = 8
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=512)))
    engine.add_request("shared", prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, n=8, seed=1))
    shared = _peak_blocks(engine)
    engine.check_integrity()
    assert engine.stats().num_free_blocks == 512
    # 32 prompt blocks once, plus one block per sample for its generated tokens
    assert shared <= 32 + 8 * 1
    unshared = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=512, enable_prefix_caching=False)))
    for i in range(8):
        unshared.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
    assert _peak_blocks(unshared) >= 8 * 32


def test_partial_last_block_is_copied_on_write(model_dir):
    """A prompt ending mid-block: every sample gets its own copy of that block, and
    greedy samples (identical by construction) all equal the n=1 answer."""
    llm = LLM(model=model_dir)
    prompt = [3 + i % 200 for i in range(37)]
    single = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0].token_ids
    many = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, n=5))[0].outputs
    assert [c.token_ids for c in many] == [single] * 5
    llm.check_integrity()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=1.0, n=6),
    SamplingParams(max_tokens=40, beam_width=4, n=2, temperature=0.0),
])
def test_abort_mid_way_frees_everything(model_dir, params):
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=256)))
    for i in range(3):
        engine.add_request(f"r{i}", [3 + i] * (20 + 9 * i), params)
    for _ in range(6):
        engine.step()
    assert engine.stats().num_free_blocks < 256
    engine.abort("r1")
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert engine.stats().num_free_blocks == 256


def test_forks_survive_a_tiny_pool(model_dir):
    """With too few blocks to fork in place, samples and beams fall back to recompute."""
    llm = LLM(model=model_dir, num_blocks=12, block_size=16)
    outs = llm.generate(
        [[5] * 40, [6] * 30],
        [SamplingParams(max_tokens=30, temperature=1.0, n=4, seed=3), SamplingParams(max_tokens=30, beam_width=3, temperature=0.0)],
    )
    assert len(outs[0].outputs) == 4 and all(len(c.token_ids) == 30 for c in outs[0].outputs)
    assert len(outs[1].outputs) == 1
    llm.check_integrity()
    assert llm.stats().num_free_blocks == 12


def test_logprobs_and_prompt_logprobs_match_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = [3 + (i * 11) % 250 for i in range(45)]
    llm = LLM(model=model_dir, max_num_batched_tokens=16)  # prompt logprobs across chunks
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, prompt_logprobs=2))[0]
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]] == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert len(entry) in (2, 3)
    for j, token in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[j]
        assert entry[token] == pytest.approx(float(ref[len(prompt) - 1 + j, token]), abs=1e-4)
        assert set(ref[len(prompt) - 1 + j].topk(3).indices.tolist()) <= set(entry)
    total = sum(float(ref[len(prompt) - 1 + j, t]) for j, t in enumerate(out.outputs[0].token_ids))
    assert out.outputs[0].cumulative_logprob == pytest.approx(total, abs=1e-3)
    llm.check_integrity()


def test_beams_share_the_prompt_blocks(model_dir):
    """k=4 beams over a 256-token prompt hold its 16 blocks once, plus their own tails."""
    prompt = [3 + (i * 5) % 250 for i in range(256)]
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=256)))
    engine.add_request("beams", prompt, SamplingParams(max_tokens=12, beam_width=4, temperature=0.0))
    peak = _peak_blocks(engine)
    engine.check_integrity()
    assert engine.stats().num_free_blocks == 256
    assert peak <= 16 + 4 * 1  # 12 new tokens fit in one block per beam


@pytest.mark.parametrize("num_blocks", [3, 5, 8, 11])
def test_groups_never_deadlock_in_a_small_pool(model_dir, num_blocks):
    """Beams wait for their siblings while holding blocks; when a preempted sibling can
    never fit again the request fails (abort) instead of the engine spinning forever."""
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=num_blocks)))
    engine.add_request("beams", [5] * 40, SamplingParams(max_tokens=30, beam_width=4, temperature=0.0))
    engine.add_request("samples", [6] * 20, SamplingParams(max_tokens=30, n=3, temperature=1.0, seed=1))
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            finished[out.request_id] = out
    assert not engine.has_unfinished(), "the engine is spinning"
    assert set(finished) == {"beams", "samples"}
    engine.check_integrity()
    assert engine.stats().num_free_blocks == num_blocks

"""Behaviours vLLM users rely on (issue 8): one test per gap found, each failing before its fix."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.errors import FailureKind
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.sampler import Sampler, apply_top_k_top_p
from engine_helpers import POISON, Poisoned
from hf_models import build_beam_model, build_model

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("semantics")
    build_model(path, "llama", seed=11)
    return str(path)


@pytest.fixture(scope="module")
def code_llm():
    return LLM(model=DEFAULT_MODEL)


def drain(engine: LLMEngine, max_steps: int = 2000) -> dict:
    out = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out[o.request_id] = o
    raise AssertionError("the engine did not finish")


def assert_all_free(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


# -- 1. stop strings wait for min_tokens ---------------------------------------------------


def _early_stop_string(llm: LLM, prompt: str, free_ids: list[int]) -> str:
    """Two characters the greedy completion produces within its first two tokens."""
    tok = llm.tokenizer
    early = tok.decode(free_ids[:2]).strip()
    assert len(early) >= 2, f"completion starts with too little text: {early!r}"
    return early[:2]


def test_stop_string_is_not_checked_before_min_tokens(code_llm):
    prompt = "import os\n\n\ndef "
    free = code_llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    stop = _early_stop_string(code_llm, prompt, free.token_ids)
    early = code_llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2  # without min_tokens it stops at once
    min_tokens = 8
    out = code_llm.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], min_tokens=min_tokens)
    )[0].outputs[0]
    assert len(out.token_ids) > min_tokens
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert out.text == _expected_cut(code_llm, free, stop, min_tokens)
    code_llm.check_integrity()


def _expected_cut(llm: LLM, free, stop: str, min_tokens: int) -> str:
    """The free run's text cut at the first stop string ending after its min_tokens-th token."""
    boundary = len(llm.tokenizer.decode(free.token_ids[:min_tokens]))
    cut = free.text.find(stop, max(0, boundary - len(stop) + 1))
    return free.text[:cut] if cut >= 0 else free.text


def test_router_cuts_where_the_engine_stops(code_llm):
    """The router's streamed text uses the engine's stop-string code: with min_tokens it
    must not cut at an occurrence the engine skips."""
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
    from pdserve.services.router.pb_records import request_of
    from pdserve.services.router.events import update_of
    from pdserve.services.router.responses import ResponseBuilder
    from pdserve.services.router.validate import Limits, Validator

    prompt = "import os\n\n\ndef "
    free = code_llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    stop = _early_stop_string(code_llm, prompt, free.token_ids)
    tok = code_llm.tokenizer
    job = Validator(Limits("m", 4096, 1024, 4, 16), tok).validate(request_of(pb.GenerateRequest(
        text=prompt, sampling=pb.SamplingOptions(max_tokens=40, temperature=0.0, stop=[stop], min_tokens=8),
    )))
    builder = ResponseBuilder(job, tok, arrival=0.0)
    text = ""
    for token in free.token_ids:
        decode = pb.DecodeResponse(deltas=[pb.SequenceDelta(index=0, token_ids=[token])])
        text += "".join(m.text for m in builder.messages(update_of(decode)))
    final = pb.DecodeResponse(finished=True, results=[pb.SequenceResult(index=0, finish_reason="stop")])
    text += "".join(m.text for m in builder.messages(update_of(final)))
    assert text == _expected_cut(code_llm, free, stop, 8)


# -- 2. prompt logprobs with n > 1 and beams ----------------------------------------------


@pytest.mark.parametrize("kind", ["n=4 seed 0", "n=4 seed 1", "beams"])
def test_prompt_logprobs_survive_forks(model_dir, kind):
    """One entry per prompt token whichever sequence finishes first (with a stop id
    the samples often sample, some fork ends before sample 0)."""
    llm = LLM(model=model_dir, max_num_batched_tokens=16)  # prompt logprobs across chunks
    prompt = [3 + (i * 7) % 250 for i in range(37)]
    single = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    likely = single.outputs[0].token_ids[0]
    if kind == "beams":
        params = SamplingParams(max_tokens=8, temperature=0.0, beam_width=3, n=2, prompt_logprobs=2)
    else:
        params = SamplingParams(max_tokens=12, temperature=1.0, top_k=3, n=4, seed=int(kind[-1]),
                                stop_token_ids=[likely], prompt_logprobs=2)
    out = llm.generate([prompt], params)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for got, want in zip(out.prompt_logprobs[1:], single.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    llm.check_integrity()


# -- 3. beam search honours stop ids and repetition penalty, refuses the rest -------------


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam-penalty")
    model, eos, greedy = build_beam_model(path, VOCAB, seed=4, eos_at=6)
    return path, model, eos, greedy


def _hf_beams(model, prompt, k, n, max_new, eos_ids, repetition_penalty):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=n, do_sample=False,
        max_new_tokens=max_new, eos_token_id=eos_ids, pad_token_id=eos_ids[0],
        repetition_penalty=repetition_penalty,
    )
    beams = []
    for row in out[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        beams.append(row if end is None else row[: end + 1])
    return beams


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3, 0.8])
def test_beam_search_honours_stop_ids_and_repetition_penalty(beam_model, repetition_penalty):
    path, model, eos, greedy = beam_model
    stop_id = greedy[1]  # a token the search really meets
    rng = random.Random(5)
    prompts = [[5, 6, 7, 8]] + [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 21)]
    llm = LLM(model=str(path))
    params = SamplingParams(max_tokens=10, beam_width=4, n=3, temperature=0.0, stop_token_ids=[stop_id],
                            repetition_penalty=repetition_penalty)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        expected = _hf_beams(model, prompt, 4, 3, 10, [eos, stop_id], repetition_penalty)
        assert [c.token_ids for c in out.outputs] == expected, f"prompt of {len(prompt)} tokens"
        for c in out.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] in (eos, stop_id) else "length")
    llm.check_integrity()


@pytest.mark.parametrize("field, value", [
    ("stop", ["x"]), ("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("logprobs", 2),
    ("top_k", 5), ("top_p", 0.9), ("min_p", 0.1),
])
def test_beam_search_refuses_what_it_would_ignore(field, value):
    with pytest.raises(ValueError, match=f"^{field}: is not supported with beam search"):
        SamplingParams(beam_width=2, **{field: value})


# -- 4. an aborted beam request returns its n best, best first -----------------------------


def _assert_n_best(out, n, length_penalty=1.0):
    assert len(out.outputs) == n
    scores = [c.cumulative_logprob / (len(c.token_ids) ** length_penalty) for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert [c.index for c in out.outputs] == list(range(n))


def test_aborted_beam_request_returns_the_n_best_in_order(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=128)))
    engine.add_request("beams", [5, 9, 13, 17], SamplingParams(max_tokens=30, beam_width=5, n=2, ignore_eos=True))
    for _ in range(6):
        engine.step()
    out = engine.abort("beams")
    _assert_n_best(out, 2)
    assert all(c.finish_reason == "abort" for c in out.outputs)
    assert all(len(c.token_ids) == 6 for c in out.outputs)  # one token a step (the first with the prefill)
    assert_all_free(engine)


def test_beam_request_that_can_never_fit_returns_its_n_best(model_dir):
    """Failed for lack of blocks (the pool cannot hold 4 beams), it still reports n, ordered."""
    llm = LLM(model=model_dir, num_blocks=6, block_size=16)
    out = llm.generate([[5] * 40], SamplingParams(max_tokens=60, beam_width=4, n=2, ignore_eos=True))[0]
    assert len(out.outputs) <= 2 and out.error is not None
    assert out.failure is FailureKind.NO_ROOM  # a typed kind, not a message prefix
    if len(out.outputs) == 2:
        _assert_n_best(out, 2)
    llm.check_integrity()
    assert llm.stats().num_free_blocks == 6


# -- 5. forks count against max_num_seqs -----------------------------------------------------


def test_forks_count_against_max_num_seqs(model_dir):
    engine = LLMEngine(EngineConfig(
        model=model_dir, cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=4),
    ))
    for i in range(3):
        engine.add_request(f"n{i}", [4 + i] * 20,
                           SamplingParams(max_tokens=12, temperature=1.0, n=2, seed=i, ignore_eos=True))
    engine.add_request("beams", [9] * 20, SamplingParams(max_tokens=12, beam_width=3, ignore_eos=True))
    peak, outs = 0, {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        peak = max(peak, len(engine.scheduler.running))
        assert engine.scheduler.num_seq_slots <= 4
    assert peak <= 4
    assert all(len(outs[f"n{i}"].outputs) == 2 for i in range(3)) and len(outs["beams"].outputs) == 1
    assert all(c.finish_reason == "length" for o in outs.values() for c in o.outputs)
    assert_all_free(engine)


@pytest.mark.parametrize("field, params", [
    ("n", SamplingParams(n=6, temperature=1.0)), ("beam_width", SamplingParams(beam_width=3, n=2)),
])
def test_group_wider_than_max_num_seqs_is_refused(model_dir, field, params):
    engine = LLMEngine(EngineConfig(model=model_dir, scheduler=SchedulerConfig(max_num_seqs=2)))
    with pytest.raises(ValueError, match=f"^{field}: .*max_num_seqs=2"):
        engine.add_request("wide", [5, 6, 7], params)
    assert not engine.has_unfinished()


# -- 6. top_p = 1 is a no-op whatever the batch companions ----------------------------------


def test_top_p_one_leaves_its_row_untouched_beside_top_p_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((3, 32000), generator=gen) * 3
    out = apply_top_k_top_p(logits, [0, 0, 40], [1.0, 0.5, 1.0])
    assert torch.equal(out[0], logits[0])  # the float32 running sum must not cut anything
    assert torch.isfinite(out[1]).sum() < 32000
    assert int(torch.isfinite(out[2]).sum()) == 40


def test_seeded_request_samples_the_same_alone_or_batched(model_dir):
    llm = LLM(model=model_dir)
    prompt = [7, 8, 9, 10, 11]
    params = SamplingParams(max_tokens=24, temperature=1.3, seed=77)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    companions = [SamplingParams(max_tokens=24, temperature=0.9, top_p=p, seed=3) for p in (0.3, 0.6, 0.95)]
    batched = llm.generate([[5] * 9, prompt, [6] * 30, [7] * 4], [companions[0], params, *companions[1:]])
    assert batched[1].outputs[0].token_ids == alone
    llm.check_integrity()


def test_a_sample_of_n_continued_alone_draws_what_it_drew_among_its_siblings(model_dir):
    """Stream migration of n > 1 (services/router/migration.py): sample i, continued as
    an n == 1 request with sample_index i from the prompt plus its own first tokens,
    samples the rest of what it sampled beside its siblings."""
    llm = LLM(model=model_dir)
    prompt = [7, 8, 9, 10, 11]
    together = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.2, seed=5, n=3,
                                                     ignore_eos=True))[0].outputs
    assert len({tuple(o.token_ids) for o in together}) == 3  # the samples differ
    for i, sample in enumerate(together):
        k = 3 + 2 * i
        alone = llm.generate([prompt + list(sample.token_ids[:k])],
                             SamplingParams(max_tokens=20 - k, temperature=1.2, seed=5, sample_index=i,
                                            ignore_eos=True))[0].outputs[0]
        assert list(sample.token_ids[:k]) + list(alone.token_ids) == list(sample.token_ids), i
    with pytest.raises(ValueError, match="sample_index"):
        SamplingParams(n=2, sample_index=1)
    llm.check_integrity()


def test_a_resumed_sequence_is_penalised_for_its_earlier_output_as_before(model_dir):
    """Presence and frequency penalties count output only: a continuation from the
    prompt plus the first k output tokens, with resumed_tokens k, counts those k as
    output and goes on as the uninterrupted run (greedy and seeded)."""
    llm = LLM(model=model_dir)
    prompt = [7, 8, 9, 10, 11, 7, 8]
    mattered = False
    for sampling in (dict(temperature=0.0), dict(temperature=1.1, seed=9)):
        penalties = dict(presence_penalty=2.0, frequency_penalty=1.0, ignore_eos=True)
        whole = llm.generate([prompt], SamplingParams(max_tokens=24, **penalties, **sampling))[0].outputs[0].token_ids
        for k in (3, 6, 9, 12):
            params = SamplingParams(max_tokens=24 - k, resumed_tokens=k, **penalties, **sampling)
            rest = llm.generate([prompt + list(whole[:k])], params)[0].outputs[0].token_ids
            assert list(whole[:k]) + list(rest) == list(whole), (sampling, k)
            unmarked = SamplingParams(max_tokens=24 - k, **penalties, **sampling)
            mattered |= llm.generate([prompt + list(whole[:k])], unmarked)[0].outputs[0].token_ids != rest
    assert mattered  # without resumed_tokens some continuation differs
    with pytest.raises(ValueError, match="resumed_tokens"):
        llm.generate([prompt], SamplingParams(resumed_tokens=len(prompt)))
    llm.check_integrity()


# -- 7. a request's prefix-cache lookup counts once ----------------------------------------------


def test_prefix_cache_queries_count_once_per_admission(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=10, block_size=16)))
    engine.add_request("long", [5] * 100, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.add_request("waits", [6] * 80, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outs = drain(engine)
    assert {o.outputs[0].finish_reason for o in outs.values()} == {"length"}
    assert engine.stats().num_preemptions == 0
    assert engine.stats().prefix_cache_queries == 100 + 80
    assert_all_free(engine)


# -- 8. logprobs validated at add_request; failures stay with their request ---------------------


def test_logprobs_are_capped_at_add_request(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{field}: must be <= 20"):
            engine.add_request("r", [5, 6], SamplingParams(**{field: 21}))
    wide = LLMEngine(EngineConfig(model=model_dir, max_logprobs=1000))  # the vocabulary (256) caps it then
    with pytest.raises(ValueError, match="^logprobs: must be <= 256"):
        wide.add_request("r", [5, 6], SamplingParams(logprobs=300))
    wide.add_request("ok", [5, 6], SamplingParams(max_tokens=2, logprobs=30, prompt_logprobs=30))
    out = drain(wide)["ok"]
    assert all(len(entry) >= 30 for entry in out.outputs[0].logprobs)
    assert_all_free(wide)


def test_max_logprobs_is_a_worker_flag():
    from pdserve.services.worker.config import WorkerConfig

    assert WorkerConfig().engine_config().max_logprobs == 20
    assert WorkerConfig(max_logprobs=5).engine_config().max_logprobs == 5


def test_bad_request_in_generate_leaves_no_blocks_behind(model_dir):
    llm = LLM(model=model_dir, num_blocks=32)
    with pytest.raises(ValueError, match="^logprobs:"):
        llm.generate([[5] * 40, [6] * 40], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, logprobs=300)])
    assert not llm.engine.has_unfinished()
    llm.check_integrity()
    assert llm.stats().num_free_blocks == 32


def _clean_prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[t for t in (rng.randrange(3, 250) for _ in range(length)) if t != POISON] for length in (5, 40, 17, 90, 3)]


def test_forward_failure_fails_only_the_request_behind_it(model_dir, caplog):
    prompts = _clean_prompts()
    params = [SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=4),
              SamplingParams(max_tokens=12, beam_width=3), SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=0.7, seed=9)]
    clean = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=64)))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        clean.add_request(f"r{i}", p, sp)
    expected = drain(clean)

    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=64)))
    engine.runner.model = Poisoned(engine.runner.model, POISON)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    for _ in range(3):
        engine.step()  # every request is running now
    engine.add_request("bad", [5, 6, POISON, 7], SamplingParams(max_tokens=12, temperature=0.0))
    with caplog.at_level(logging.ERROR, logger="pdserve.engine.core"):
        outs = drain(engine)
    assert outs["bad"].outputs[0].finish_reason == "abort" and "device fault" in outs["bad"].error
    assert outs["bad"].failure is FailureKind.INTERNAL
    assert any("bad" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    for rid, want in expected.items():
        assert [c.token_ids for c in outs[rid].outputs] == [c.token_ids for c in want.outputs], rid
        assert outs[rid].error is None and outs[rid].failure is None
    assert_all_free(engine)


def test_sampling_failure_fails_only_its_row(model_dir):
    class FaultySampler(Sampler):
        def sample(self, logits, requests):
            if any(r.sampling_params.seed == 666 for r in requests):
                raise RuntimeError("sampling fault")
            return super().sample(logits, requests)

    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=64)))
    engine.core.sampler = FaultySampler()
    for i in range(4):
        engine.add_request(f"ok{i}", [5 + i] * 10, SamplingParams(max_tokens=6, temperature=0.8, seed=i, n=1 + i % 2))
    engine.add_request("bad", [9] * 10, SamplingParams(max_tokens=6, temperature=0.8, seed=666))
    outs = drain(engine)
    assert outs["bad"].outputs[0].finish_reason == "abort" and "sampling fault" in outs["bad"].error
    assert outs["bad"].failure is FailureKind.INTERNAL
    for i in range(4):
        assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in outs[f"ok{i}"].outputs)
    assert_all_free(engine)


# -- shared validation: floats ----------------------------------------------------------------


@pytest.mark.parametrize("field", [
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "length_penalty",
])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be a finite number"):
        SamplingParams(**{field: value})

"""Resuming a stream on another router (resume.py, the responses' resume state, the
client's side): tokens bound to the caller and the request, each bad field named,
text and counts continuing where the broken stream stopped."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import _Resumable
from pdserve.services.router.events import update_of
from pdserve.services.router.migration import resumed_progress
from pdserve.services.router.records import Request, Resume, ResumedSequence
from pdserve.services.router.responses import ResponseBuilder
from pdserve.services.router.resume import Resumes
from pdserve.services.router.validate import Limits, Validator

VOCAB, MAX_LEN = 4096, 256
VALIDATOR = Validator(Limits("tiny", vocab_size=VOCAB, max_model_len=MAX_LEN, max_n=4, block_size=16), None)
PROMPT = tuple(range(100, 120))
RESUMES = Resumes(b"a cluster token of at least 32 characters")


def job(prompt=PROMPT, salt="s", **sampling):
    sampling.setdefault("max_tokens", 32)
    return VALIDATOR.validate(Request(token_ids=prompt, sampling=SamplingParams(**sampling), cache_salt=salt))


def resume(token: bytes, *sequences: ResumedSequence) -> Resume:
    return Resume(token, sequences)


def resumed(of, token, *sequences, key_id=""):
    return RESUMES.job(of, resume(token, *sequences), "tiny", key_id, VOCAB, MAX_LEN)


def seq(index=0, tokens=(5, 6, 7), logprob_sum=-1.25, finish=None):
    return ResumedSequence(index, tuple(tokens), logprob_sum, finish)


def test_a_token_resumes_the_same_request_of_the_same_caller():
    original = job(temperature=1.0, seed=3)
    token = RESUMES.token(original, "tiny", "key-a")
    assert token == RESUMES.token(job(temperature=1.0, seed=3), "tiny", "key-a")  # any router of the cluster
    again = resumed(job(temperature=1.0, seed=3), token, seq(), key_id="key-a")
    assert again.resumed == (seq(),)
    assert again.prompt == original.prompt and again.params == original.params


@pytest.mark.parametrize("change, field", [
    (dict(salt="another"), "cache_salt"),
    (dict(key_id="key-b"), "cache_salt"),
    (dict(prompt=PROMPT + (1,)), "resume.token"),
    (dict(seed=4), "resume.token"),
    (dict(model="other"), "resume.token"),
])
def test_a_token_for_another_caller_salt_prompt_or_sampling_is_refused_naming_it(change, field):
    token = RESUMES.token(job(temperature=1.0, seed=3), "tiny", "key-a")
    key_id, model = change.pop("key_id", "key-a"), change.pop("model", "tiny")
    sampling = dict(temperature=1.0, seed=change.pop("seed", 3))
    with pytest.raises(ValueError, match=f"^{field}:"):
        RESUMES.job(job(**change, **sampling), resume(token, seq()), model, key_id, VOCAB, MAX_LEN)


def test_a_forged_or_foreign_token_is_refused_and_a_router_without_a_cluster_token_issues_none():
    original = job()
    with pytest.raises(ValueError, match="^resume.token:"):
        resumed(original, b"\x01" + bytes(32), seq())
    with pytest.raises(ValueError, match="^resume.token:"):
        resumed(original, b"short", seq())
    other_cluster = Resumes(b"another cluster's token, also long enough").token(original, "tiny", "")
    with pytest.raises(ValueError, match="^resume.token:"):
        resumed(original, other_cluster, seq())
    no_key = Resumes(None)
    assert no_key.token(original, "tiny", "") == b""
    with pytest.raises(ValueError, match="^resume.token: this router has no cluster token"):
        no_key.job(original, resume(b"", seq()), "tiny", "", VOCAB, MAX_LEN)


@pytest.mark.parametrize("sampling, sequences, message", [
    ({}, [seq(tokens=(VOCAB,))], r"resume.sequences\[0\].token_ids: token id 4096 is outside the vocabulary"),
    ({}, [seq(tokens=(-1,))], r"resume.sequences\[0\].token_ids: token id -1"),
    ({}, [seq(tokens=(1,) * 33)], r"resume.sequences\[0\].token_ids: 33 tokens, more than max_tokens 32"),
    (dict(max_tokens=200), [seq(tokens=(1,) * 237)], r"resume.sequences\[0\].token_ids: .* exceed max_model_len"),
    ({}, [seq(0), seq(1)], r"resume.sequences: 2 sequences, more than the request's n=1"),
    (dict(n=2, temperature=1.0), [seq(2)], r"resume.sequences\[0\].index: 2 is not a sequence"),
    (dict(n=2, temperature=1.0), [seq(1), seq(1)], r"resume.sequences\[1\].index: sequence 1 given twice"),
    ({}, [seq(logprob_sum=math.nan)], r"resume.sequences\[0\].logprob_sum"),
    ({}, [seq(finish="done")], r"resume.sequences\[0\].finish_reason"),
    (dict(beam_width=2, n=2), [seq()], r"resume: beam search"),
])
def test_each_bad_sequence_is_refused_naming_its_field(sampling, sequences, message):
    original = job(**sampling)
    with pytest.raises(ValueError, match=message):
        resumed(original, RESUMES.token(original, "tiny", ""), *sequences)


def test_a_resumes_progress_is_a_migrations_and_a_full_sequence_has_ended():
    original = job(n=2, temperature=1.0, max_tokens=3)
    progress = resumed_progress(replace(original, resumed=(seq(0, (1, 2, 3)), seq(1, (4,), -0.5))))
    assert progress.migrations == 1
    assert progress.sample(0).finish_reason == "length" and progress.sample(1).finish_reason is None
    assert progress.unfinished() == [1] and progress.bases() == {0: -1.25, 1: -0.5}
    assert resumed_progress(original) is None
    assert resumed_progress(replace(original, resumed=(seq(0, ()),))) is None  # nothing arrived: served afresh


def delta(tokens, logprobs, finish=""):
    return update_of(pb.DecodeResponse(deltas=[pb.SequenceDelta(index=0, token_ids=tokens, token_logprobs=logprobs,
                                                                finish_reason=finish)]))


def end(cumulative):
    return update_of(pb.DecodeResponse(finished=True, results=[pb.SequenceResult(
        index=0, finish_reason="length", cumulative_logprob=cumulative)]))


@pytest.mark.parametrize("cut", [1, 3, 5])
def test_a_resumed_builder_sends_what_the_broken_stream_would_have_sent_next(cut):
    tokenizer = Tokenizer(DEFAULT_MODEL)
    ids = tokenizer.encode("héllo wörld, naïve café! stop here", add_special_tokens=False)[:8]
    logprobs = [-0.5 * (i + 1) for i in range(len(ids))]
    prompt = tuple(tokenizer.encode("x = ", add_special_tokens=False))
    validator = Validator(VALIDATOR.limits, tokenizer)
    whole = validator.validate(Request(token_ids=prompt, sampling=SamplingParams(max_tokens=8, stop=("here",))))
    token = b"t" * 33
    undisturbed = ResponseBuilder(whole, tokenizer, 0.0, resume_token=token)
    outputs = [undisturbed.messages(delta([t], [lp]))[0] for t, lp in zip(ids, logprobs)]
    assert outputs[0].resume_state.token == token and all(o.resume_state.token == b"" for o in outputs[1:])
    assert [o.resume_state.logprob_sum for o in outputs] == pytest.approx(list(
        sum(logprobs[:i + 1]) for i in range(len(ids))))
    before = ResumedSequence(0, tuple(ids[:cut]), outputs[cut - 1].resume_state.logprob_sum)
    builder = ResponseBuilder(replace(whole, resumed=(before,)), tokenizer, 0.0, resume_token=token)
    rest = [builder.messages(delta([t], [lp])) for t, lp in zip(ids[cut:], logprobs[cut:])]
    assert [o[0].text if o else "" for o in rest] == [o.text for o in outputs[cut:]]
    final = builder.messages(end(sum(logprobs)))[0]
    assert final.usage.completion_tokens == len(ids) and final.usage.prompt_tokens == len(prompt)
    assert final.text == undisturbed.messages(end(sum(logprobs)))[0].text


def test_the_client_keeps_what_arrived_drops_a_final_it_has_and_asks_to_resume_from_it():
    request = pb.GenerateRequest(text="hi", resumable=True, sampling=pb.SamplingOptions(n=2))
    stream = _Resumable(request, None)
    state = pb.ResumeState
    assert stream.why_not() is not None  # no token yet
    assert stream.seen(pb.GenerateResponse(request_id="r1", index=0, token_ids=[1, 2],
                                           resume_state=state(token=b"tok", logprob_sum=-1.0)))
    assert stream.seen(pb.GenerateResponse(request_id="r1", index=1, token_ids=[3],
                                           resume_state=state(logprob_sum=-0.5, finish_reason="stop")))
    assert stream.seen(pb.GenerateResponse(request_id="r1", index=1, finish_reason="stop",
                                           resume_state=state(logprob_sum=-0.5, finish_reason="stop")))
    assert stream.why_not() is None and not stream.complete
    stream.resume()
    sent = stream._sent
    assert sent.request_id == "r1" and sent.resume.token == b"tok" and sent.text == "hi"
    assert [(s.index, list(s.token_ids), s.logprob_sum, s.finish_reason) for s in sent.resume.sequences] == [
        (0, [1, 2], -1.0, ""), (1, [3], -0.5, "stop")]
    # the resumed router sends every sequence's final message: the one that arrived is dropped
    assert not stream.seen(pb.GenerateResponse(index=1, finish_reason="stop"))
    assert stream.seen(pb.GenerateResponse(index=0, token_ids=[4], finish_reason="length"))
    assert stream.complete
    assert _Resumable(pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(beam_width=2)), None).why_not() \
        == "beam search is never resumed"

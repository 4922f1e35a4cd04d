"""Stop strings spanning a migration's cut (services/router/stops.py): the router sees
the whole output, the continuation's worker only what follows its prompt."""

from __future__ import annotations

import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.events import update_of
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.router.records import Request
from pdserve.services.router.stops import StopWatch, stop_watch
from pdserve.services.router.validate import Limits, Validator

BLOCK = 16


def delta(tokens, logprobs=(), finish="", finished=False):
    """A worker's message with sequence 0's `tokens`, as the router's update."""
    lps = [pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(tokens, logprobs)]
    message = pb.DecodeResponse(deltas=[pb.SequenceDelta(index=0, token_ids=tokens, logprobs=lps,
                                                         token_logprobs=list(logprobs), finish_reason=finish)])
    if finished:
        message.finished = True
        message.results.add(index=0, finish_reason=finish or "length", cumulative_logprob=-1.0)
    return update_of(message)


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.engine.config import DEFAULT_MODEL
    from pdserve.engine.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL)
    tok.load()
    return tok


def stop_job(tokenizer, stop):
    validator = Validator(Limits("tiny", vocab_size=4096, max_model_len=256, max_n=4,
                                 block_size=BLOCK), tokenizer)
    return validator.validate(Request(text="def f(x):", sampling=SamplingParams(max_tokens=100, stop=stop)))


def test_a_stop_string_begun_before_the_cut_ends_the_continuation_where_the_uninterrupted_run_would(tokenizer):
    output = tokenizer.encode("    return x + 1\n\nprint(f(2))", add_special_tokens=False)
    text = tokenizer.decode(output)
    stop = "x + 1\n\npr"
    original = stop_job(tokenizer, (stop,))
    # Cut after the token holding "x": the stop string began before the cut.
    k = next(i for i in range(1, len(output)) if "x" in tokenizer.decode(output[:i]))
    assert stop not in tokenizer.decode(output[:k])
    watch = StopWatch(tokenizer, original, output[:k])
    rest = output[k:]
    message = delta(rest, [-0.1] * len(rest))
    cut = watch.cut(message)
    assert cut is not None
    kept = list(cut.tokens[0].token_ids)
    end = k + len(kept)  # the uninterrupted run ends with the token completing the stop string
    assert stop in tokenizer.decode(output[:end]) and stop not in tokenizer.decode(output[:end - 1])
    assert len(cut.tokens[0].logprobs) == len(kept) and cut.tokens[0].finish_reason == "stop"
    assert not cut.finished and text.startswith(tokenizer.decode(output[:end]))
    assert len(cut.tokens[0].token_logprobs) == len(kept)
    assert message == delta(rest, [-0.1] * len(rest))  # a new update: the worker's is as it came


def test_a_stop_the_worker_saw_too_passes_through(tokenizer):
    output = tokenizer.encode("    return x + 1\n", add_special_tokens=False)
    watch = StopWatch(tokenizer, stop_job(tokenizer, ("\n",)), output[:2])
    message = delta(output[2:], finish="stop")
    assert watch.cut(message) is None and list(message.tokens[0].token_ids) == output[2:]
    other = StopWatch(tokenizer, stop_job(tokenizer, ("zzz",)), output[:2])
    assert other.cut(delta(output[2:])) is None


def test_a_cut_in_the_workers_final_update_is_no_longer_final(tokenizer):
    """The worker ended later (max_tokens) than the stop string the router sees: the
    cut update ends the sequence, and the caller sends the final update itself."""
    output = tokenizer.encode("    return x + 1\n\nprint(f(2))", add_special_tokens=False)
    k = next(i for i in range(1, len(output)) if "x" in tokenizer.decode(output[:i]))
    watch = StopWatch(tokenizer, stop_job(tokenizer, ("1\n",)), output[:k])
    cut = watch.cut(delta(output[k:], finish="length", finished=True))
    assert cut is not None and cut.end is None and cut.tokens[0].finish_reason == "stop"
    assert "1\n" in tokenizer.decode(output[:k] + list(cut.tokens[0].token_ids))


def test_only_a_migrated_request_with_stop_strings_and_a_tokenizer_is_watched(tokenizer):
    job = stop_job(tokenizer, ("\n",))
    assert isinstance(stop_watch(tokenizer, job, [1, 2], migrated=True), StopWatch)
    assert stop_watch(tokenizer, job, [1, 2], migrated=False) is None
    assert stop_watch(None, job, [1, 2], migrated=True) is None
    assert stop_watch(tokenizer, stop_job(tokenizer, ()), [1, 2], migrated=True) is None

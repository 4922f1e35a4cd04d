"""Fan-out (services/router/fan_out.py): an n > 1 request's unfinished samples go on
as requests of their own, merged back under their indices; one final update."""

from __future__ import annotations

import pytest

from pdserve.services.common.deadline import Deadline
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.events import Finished, Result, Tokens, Update
from pdserve.services.router.fan_out import fan_out
from pdserve.services.router.migration import Progress, Sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.router.records import Request
from pdserve.services.router.validate import Limits, Validator

JOB = Validator(Limits("tiny", vocab_size=4096, max_model_len=256, max_n=4, block_size=16), None).validate(
    Request(token_ids=tuple(range(100, 120)), sampling=SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1)))


def progress() -> Progress:
    """Sample 0 ended ("stop"); 1 and 2 had sent a token each."""
    return Progress(n=3, migrations=1, samples={
        0: Sample([5], -0.5, "stop", -0.5), 1: Sample([6], -0.25, None, -0.25), 2: Sample([7], -1.0, None, -1.0)})


def test_each_unfinished_sample_continues_and_one_final_update_ends_the_request():
    asked = {}

    def serve(one, sample, cancel):
        index = one.params.sample_index
        asked[index] = (one.params.n, list(sample.token_ids))
        yield Update((Tokens(0, (10 + index,), (), (-0.1,), "length"),))
        yield Update(end=Finished((Result(0, "length", -2.0 - index),), num_cached_tokens=20, num_draft_tokens=index))

    updates = list(fan_out(JOB, progress(), Deadline.after(10), Cancellation(), serve))
    assert asked == {1: (1, [6]), 2: (1, [7])}  # sample 0 had ended: not continued
    streamed = sorted((t.index, t.token_ids) for u in updates[:-1] for t in u.tokens)
    assert streamed == [(1, (11,)), (2, (12,))] and all(u.end is None for u in updates[:-1])
    end = updates[-1].end
    assert [(r.index, r.finish_reason, r.cumulative_logprob) for r in end.results] == [
        (0, "stop", -0.5), (1, "length", -3.0), (2, "length", -4.0)]
    assert end.num_draft_tokens == 3 and end.num_cached_tokens == 20


def test_the_first_failing_sample_fails_the_request_and_cancels_the_others():
    cancels = []

    def serve(one, sample, cancel):
        cancels.append(cancel)
        if one.params.sample_index == 1:
            raise RuntimeError("sample 1 failed")
        yield Update((Tokens(0, (9,)),))

    with pytest.raises(RuntimeError, match="sample 1 failed"):
        list(fan_out(JOB, progress(), Deadline.after(10), Cancellation(), serve))
    assert cancels and all(c.cancelled for c in cancels)

"""The router's front end (services/router/frontend.py) on its own: a fake dispatcher
that replays scripted worker messages, no worker, no server, no process.

    Request -> generate: draining? tenant? validate -> Job, deadline, admission slot
            -> Generation: the dispatcher's messages as SequenceOutputs; cancel, close
    drain(grace): admit nothing new; what is left past the grace fails UNAVAILABLE

Each test checks what the caller sees (outputs, ServeError status and message) and
what the front end keeps (admission slots, in-flight count, failure metrics).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.api_keys import ApiKeys, key_id
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.events import Update, update_of
from pdserve.services.router.frontend import FrontEnd
from pdserve.services.router.records import Request
from pdserve.services.router.validate import Job, Limits

LIMITS = Limits("tiny", vocab_size=1000, max_model_len=64, max_n=4, block_size=4)
PROMPT = (5, 6, 7, 8, 9)
KEY = "k" * 24


def tokens(*token_ids: int, index: int = 0) -> Update:
    """A worker message with new tokens of sequence `index`, as the dispatcher yields it."""
    return update_of(pb.DecodeResponse(deltas=[pb.SequenceDelta(index=index, token_ids=token_ids)]))


def finished(reason: str = "length", cached: int = 0, index: int = 0) -> Update:
    return update_of(pb.DecodeResponse(
        finished=True, num_cached_tokens=cached,
        results=[pb.SequenceResult(index=index, finish_reason=reason, cumulative_logprob=-1.5)]))


class FakeDispatcher:
    """Replays `script` for every job: worker messages, or a callable run in their
    place (to block, to raise). Records what each run was given, and whether its
    generator was closed (what frees a real dispatcher's worker calls)."""

    def __init__(self, *script: Update | Callable[[Cancellation], None]) -> None:
        self.script = script
        self.jobs: list[Job] = []
        self.deadlines: list[Deadline] = []
        self.cancellations: list[Cancellation] = []
        self.closed = 0

    def run(self, job: Job, deadline: Deadline, cancel: Cancellation, note_cached: Callable[[int], None]
            ) -> Iterator[Update]:
        self.jobs.append(job)
        self.deadlines.append(deadline)
        self.cancellations.append(cancel)
        return self._replay(cancel)

    def _replay(self, cancel: Cancellation) -> Iterator[Update]:
        try:
            for step in self.script:
                if callable(step):
                    step(cancel)
                else:
                    yield step
        finally:
            self.closed += 1


def waits_for_cancel(cancel: Cancellation) -> None:
    """What a real dispatcher does when its caller leaves mid-stream."""
    gone = threading.Event()
    cancel.add_callback(gone.set)
    assert gone.wait(10.0), "never cancelled"
    raise ServeError(Status.CANCELLED, "cancelled")


def front_end(dispatcher: FakeDispatcher, api_keys: ApiKeys | None = None, **config) -> FrontEnd:
    settings = dict(port=0, max_concurrent_requests=1, max_queued_requests=0, max_queue_wait=0.0)
    return FrontEnd(RouterConfig(**{**settings, **config}), LIMITS, None, dispatcher, RouterMetrics("tiny"), api_keys)


def failures(front: FrontEnd, code: str) -> float:
    labels = {"model_name": "tiny", "role": "router", "worker": "router", "code": code}
    return front.metrics.registry.get_sample_value("pdserve:request_failure_total", labels) or 0.0


def in_flight(front: FrontEnd) -> float:
    labels = {"model_name": "tiny", "role": "router", "worker": "router"}
    return front.metrics.registry.get_sample_value("pdserve:num_requests_inflight", labels)


def refused(front: FrontEnd, request: Request) -> ServeError:
    with pytest.raises(ServeError) as info:
        front.generate(request)
    return info.value


# -- a request's way through ----------------------------------------------------------------


def test_a_request_becomes_a_job_and_the_workers_messages_become_its_outputs():
    dispatcher = FakeDispatcher(tokens(11, 12), tokens(13), finished("length", cached=4))
    front = front_end(dispatcher)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    stream = front.generate(Request(token_ids=PROMPT, sampling=params, request_id="mine", cache_salt="s"))
    assert (stream.request_id, stream.prompt_token_ids) == ("mine", PROMPT)
    outputs = list(stream)
    [job] = dispatcher.jobs
    assert (job.request_id, job.prompt, job.params) == ("mine", PROMPT, SamplingParams(max_tokens=3, temperature=0.0,
                                                                                      cache_salt="s"))
    assert job.worker_request_id != "mine" and job.block_hashes == tuple(hash_blocks(list(PROMPT), 4, cache_salt="s"))
    assert [o.token_ids for o in outputs] == [(11, 12), (13,), ()]
    last = outputs[-1]
    assert (last.finish_reason, last.cumulative_logprob) == ("length", -1.5)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (5, 3, 4)
    assert stream.status is None and dispatcher.closed == 1
    assert in_flight(front) == 0 and front.admission.retry_after() >= 0
    with front.generate(Request(token_ids=PROMPT)):  # the one slot is free again
        pass


def test_a_request_without_an_id_gets_the_one_its_workers_see():
    dispatcher = FakeDispatcher(finished())
    stream = front_end(dispatcher).generate(Request(token_ids=PROMPT))
    list(stream)
    assert stream.request_id == dispatcher.jobs[0].request_id == dispatcher.jobs[0].worker_request_id != ""


def test_a_bad_request_is_refused_naming_the_field_before_any_worker_or_slot():
    dispatcher = FakeDispatcher(finished())
    front = front_end(dispatcher)
    cases = [
        (Request(token_ids=PROMPT, model="gpt-9"), "model: "),
        (Request(), "prompt: set text or token_ids"),
        (Request(token_ids=(1, 5000)), "token_ids: "),
        (Request(text="hi"), "prompt: text given but the model has no tokenizer"),
        (Request(token_ids=PROMPT, sampling=SamplingParams(max_tokens=60)), "max_tokens: "),
        (Request(token_ids=PROMPT, sampling=SamplingParams(n=5)), "n: must be <= 4 (max_n)"),
        (Request(token_ids=PROMPT, sampling=SamplingParams(max_tokens=2**40)), "max_tokens: "),  # past int32
        (Request(token_ids=PROMPT, cache_salt="s" * 1000), "cache_salt: "),
    ]
    for request, start in cases:
        error = refused(front, request)
        assert error.status is Status.INVALID_ARGUMENT and error.message.startswith(start), error.message
    assert failures(front, "INVALID_ARGUMENT") == len(cases) and in_flight(front) == 0
    assert dispatcher.jobs == []


def test_a_request_its_adapter_could_not_build_is_refused_and_counted():
    front = front_end(FakeDispatcher())
    with pytest.raises(ValueError) as info:
        SamplingParams(temperature=-1.0)
    error = front.refuse(info.value)
    assert error.status is Status.INVALID_ARGUMENT and error.message.startswith("temperature: must be >= 0")
    assert failures(front, "INVALID_ARGUMENT") == 1 and in_flight(front) == 0


def test_fill_context_takes_what_the_prompt_leaves_below_max_model_len():
    dispatcher = FakeDispatcher(finished())
    front = front_end(dispatcher)
    list(front.generate(Request(token_ids=PROMPT, sampling=SamplingParams(max_tokens=64), fill_context=True)))
    assert dispatcher.jobs[-1].params.max_tokens == 64 - len(PROMPT)
    list(front.generate(Request(token_ids=PROMPT, sampling=SamplingParams(max_tokens=10), fill_context=True)))
    assert dispatcher.jobs[-1].params.max_tokens == 10  # a smaller cap stays
    list(front.generate(Request(token_ids=tuple(range(1, 64)), sampling=SamplingParams(max_tokens=64),
                                fill_context=True)))
    assert dispatcher.jobs[-1].params.max_tokens == 1  # the longest prompt leaves one
    error = refused(front, Request(token_ids=PROMPT, sampling=SamplingParams(max_tokens=64, min_tokens=62),
                                   fill_context=True))
    assert error.message.startswith("min_tokens: ")


# -- admission, deadlines, tenants ---------------------------------------------------------


def test_a_full_router_refuses_with_a_retry_hint_and_a_closed_stream_frees_its_slot():
    dispatcher = FakeDispatcher(finished())
    front = front_end(dispatcher)
    holder = front.generate(Request(token_ids=PROMPT))
    error = refused(front, Request(token_ids=PROMPT))
    assert error.status is Status.RESOURCE_EXHAUSTED and "--max-concurrent-requests" in error.message
    assert error.retry_after_s is not None and error.retry_after_s > 0
    assert failures(front, "RESOURCE_EXHAUSTED") == 1 and in_flight(front) == 1
    holder.close()  # never read: its caller left
    assert holder.status is Status.CANCELLED and dispatcher.jobs == [] and in_flight(front) == 0
    holder.close()  # twice: counted once
    assert failures(front, "CANCELLED") == 1
    list(front.generate(Request(token_ids=PROMPT)))
    assert len(dispatcher.jobs) == 1


def test_the_callers_deadline_is_capped_at_the_request_timeout():
    dispatcher = FakeDispatcher(finished())
    front = front_end(dispatcher, request_timeout=30.0)
    list(front.generate(Request(token_ids=PROMPT)))
    list(front.generate(Request(token_ids=PROMPT, deadline=Deadline.after(2.0))))
    list(front.generate(Request(token_ids=PROMPT, deadline=Deadline.after(3600.0))))
    none, short, long = (d.remaining() for d in dispatcher.deadlines)
    assert 29.0 < none <= 30.0 and 1.0 < short <= 2.0 and 29.0 < long <= 30.0


def test_salting_by_key_puts_the_tenant_in_front_of_the_salt_and_a_revoked_key_is_refused(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    api_keys = ApiKeys(str(keys))
    dispatcher = FakeDispatcher(finished())
    front = front_end(dispatcher, api_keys, salt_cache_by_key=True, api_keys_file=str(keys))
    list(front.generate(Request(token_ids=PROMPT, cache_salt="mine", authorization=f"Bearer {KEY}")))
    list(front.generate(Request(token_ids=PROMPT, authorization=f"Bearer {KEY}")))
    salts = [job.params.cache_salt for job in dispatcher.jobs]
    assert salts == [f"{key_id(KEY)}/mine", f"{key_id(KEY)}/"]
    assert dispatcher.jobs[0].block_hashes == tuple(hash_blocks(list(PROMPT), 4, cache_salt=salts[0]))
    keys.write_text("# every key revoked\n")
    assert api_keys.reload()
    error = refused(front, Request(token_ids=PROMPT, authorization=f"Bearer {KEY}"))
    assert error.status is Status.UNAUTHENTICATED and failures(front, "UNAUTHENTICATED") == 1


# -- ends: failure, cancel, drain ----------------------------------------------------------


def test_a_workers_failure_reaches_the_caller_with_its_status_and_a_retry_hint():
    def full(_cancel: Cancellation) -> None:
        raise ServeError(Status.RESOURCE_EXHAUSTED, "every decode worker is full")

    front = front_end(FakeDispatcher(tokens(11), full))
    stream = front.generate(Request(token_ids=PROMPT))
    assert next(stream).token_ids == (11,)
    with pytest.raises(ServeError) as info:
        next(stream)
    assert info.value.status is Status.RESOURCE_EXHAUSTED and info.value.retry_after_s is not None
    assert stream.status is Status.RESOURCE_EXHAUSTED and failures(front, "RESOURCE_EXHAUSTED") == 1
    assert in_flight(front) == 0


def test_an_unexpected_error_ends_the_request_unknown():
    def broken(_cancel: Cancellation) -> None:
        raise RuntimeError("a bug")

    front = front_end(FakeDispatcher(broken))
    stream = front.generate(Request(token_ids=PROMPT))
    with pytest.raises(RuntimeError):
        list(stream)
    assert stream.status is Status.UNKNOWN and failures(front, "UNKNOWN") == 1 and in_flight(front) == 0


def test_a_caller_that_leaves_mid_stream_ends_the_iteration_and_the_workers_calls():
    dispatcher = FakeDispatcher(tokens(11), waits_for_cancel, tokens(12))
    front = front_end(dispatcher)
    stream = front.generate(Request(token_ids=PROMPT))
    assert next(stream).token_ids == (11,)
    threading.Timer(0.1, stream.cancel).start()  # the caller's transport, from another thread
    assert list(stream) == []  # nothing more is said to a caller gone
    assert dispatcher.cancellations[0].cancelled and dispatcher.closed == 1
    assert stream.status is Status.CANCELLED and failures(front, "CANCELLED") == 1 and in_flight(front) == 0


def test_a_caller_gone_past_its_deadline_counts_deadline_exceeded():
    dispatcher = FakeDispatcher(tokens(11), waits_for_cancel)
    front = front_end(dispatcher)
    stream = front.generate(Request(token_ids=PROMPT, deadline=Deadline.after(0.2)))
    next(stream)
    time.sleep(0.2)
    stream.cancel()
    assert list(stream) == [] and stream.status is Status.DEADLINE_EXCEEDED
    assert failures(front, "DEADLINE_EXCEEDED") == 1


def test_draining_admits_nothing_new_and_returns_at_once_when_idle():
    front = front_end(FakeDispatcher(finished()))
    assert not front.draining
    assert front.drain(grace=5.0) and front.draining and not front.cut
    error = refused(front, Request(token_ids=PROMPT))
    assert error.status is Status.UNAVAILABLE and "draining" in error.message
    assert failures(front, "UNAVAILABLE") == 1


def test_a_drain_lets_a_request_finish_within_its_grace():
    release = threading.Event()
    dispatcher = FakeDispatcher(tokens(11), lambda _cancel: release.wait(10.0), finished())
    front = front_end(dispatcher)
    stream = front.generate(Request(token_ids=PROMPT))
    outputs = []
    reader = threading.Thread(target=lambda: outputs.extend(stream))
    reader.start()
    threading.Timer(0.2, release.set).start()
    assert front.drain(grace=10.0)  # it finished in time
    reader.join(10.0)
    assert [o.finish_reason for o in outputs] == [None, "length"] and stream.status is None


def test_a_request_still_running_when_the_grace_ends_fails_unavailable():
    release = threading.Event()
    dispatcher = FakeDispatcher(tokens(11), lambda _cancel: release.wait(10.0), tokens(12), finished())
    front = front_end(dispatcher)
    stream = front.generate(Request(token_ids=PROMPT))
    errors: list[ServeError] = []

    def read() -> None:
        try:
            list(stream)
        except ServeError as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    result: list[bool] = []
    drainer = threading.Thread(target=lambda: result.append(front.drain(grace=0.1)))
    drainer.start()
    for _ in range(200):  # the grace runs out: the front end cuts
        if front.cut:
            break
        time.sleep(0.01)
    release.set()  # the next worker message meets the cut
    reader.join(10.0)
    drainer.join(10.0)
    assert result == [False] and front.cut
    assert [e.status for e in errors] == [Status.UNAVAILABLE] and "shut down" in errors[0].message
    assert stream.status is Status.UNAVAILABLE and in_flight(front) == 0

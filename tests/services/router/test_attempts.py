"""The attempts loop (services/router/attempts.py): one decode worker after another
until one serves, without a process (fake_workers.py's registry)."""

from __future__ import annotations

import pytest

from fake_workers import FakeRegistry, FakeWorker
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.metrics import Disabled
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.attempts import Attempt, Attempts, Broken, Path
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.events import Finished, Result, Tokens, Update
from pdserve.services.router.failures import WorkerFailed
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.router.records import Request
from pdserve.services.router.validate import Limits, Validator

JOB = Validator(Limits("tiny", vocab_size=4096, max_model_len=256, max_n=4, block_size=16), None).validate(
    Request(token_ids=tuple(range(100, 120)), sampling=SamplingParams(max_tokens=4)))
CONFIG = RouterConfig(port=0, max_attempts=3, admission_timeout=0.0)
TOKEN = Update((Tokens(0, (5,), (), (-0.5,)),))
END = Update(end=Finished((Result(0, "length", -0.5),)))


def scripted(plan: dict[str, list]):
    """A `serve` that plays each worker's script: updates, or a WorkerFailed to raise."""
    seen: list[Attempt] = []

    def serve(decode, job, attempt):
        seen.append(attempt)
        for step in plan[decode.worker_id]:
            if isinstance(step, WorkerFailed):
                raise step
            if step is TOKEN:
                attempt.produced = True
            yield step
    return serve, seen


def attempts_of(registry: FakeRegistry, plan: dict[str, list], tried=None, cancel=None):
    serve, seen = scripted(plan)
    tried = [] if tried is None else tried
    updates = list(Attempts(registry, CONFIG, Disabled()).run(JOB, serve, Deadline.after(10), cancel or Cancellation(),
                                                               tried))
    assert registry.booked == 0
    return updates, seen


def test_the_first_worker_that_serves_ends_the_attempts():
    workers = [FakeWorker("d1"), FakeWorker("d2")]
    updates, seen = attempts_of(FakeRegistry(workers), {"d1": [WorkerFailed("down")], "d2": [TOKEN, END]})
    assert updates == [TOKEN, END]
    assert [a.number for a in seen] == [0, 1] and seen[0].worker_request_id != seen[1].worker_request_id


def test_numbers_count_every_worker_tried_for_the_request():
    """A continuation's attempts go on from its predecessors': its ids never repeat."""
    before = [FakeWorker("old")]
    updates, seen = attempts_of(FakeRegistry([FakeWorker("d1")]), {"d1": [END]}, tried=before)
    assert [a.number for a in seen] == [1] and seen[0].worker_request_id == f"{JOB.worker_request_id}-1"


def test_a_failure_after_a_token_is_broken_for_the_caller_to_migrate():
    worker = FakeWorker("d1")
    with pytest.raises(Broken) as info:
        attempts_of(FakeRegistry([worker, FakeWorker("d2")]), {"d1": [TOKEN, WorkerFailed("died")], "d2": [END]})
    assert info.value.decode is worker and "died" in str(info.value.error)


def test_a_failure_after_the_final_update_is_broken_too():
    """The final update reached the client: the caller knows the request is served."""
    with pytest.raises(Broken):
        attempts_of(FakeRegistry([FakeWorker("d1")]), {"d1": [END, WorkerFailed("closed")]})


def test_out_of_attempts_fails_unavailable_or_full():
    workers = [FakeWorker(f"d{i}") for i in range(4)]
    plan = {w.worker_id: [WorkerFailed("down")] for w in workers}
    with pytest.raises(ServeError, match="d0: down; d1: down; d2: down") as info:
        attempts_of(FakeRegistry(workers), plan)  # --max-attempts 3: d3 never asked
    assert info.value.status is Status.UNAVAILABLE
    plan["d0"] = [WorkerFailed("full", busy=True)]
    with pytest.raises(ServeError) as info:
        attempts_of(FakeRegistry(workers), plan)
    assert info.value.status is Status.RESOURCE_EXHAUSTED


def test_no_worker_at_all_and_a_caller_gone():
    with pytest.raises(ServeError, match="no decode worker is registered") as info:
        attempts_of(FakeRegistry([]), {})
    assert info.value.status is Status.UNAVAILABLE
    cancel = Cancellation()
    cancel.cancel()
    with pytest.raises(ServeError) as info:
        attempts_of(FakeRegistry([]), {}, cancel=cancel)
    assert info.value.status is Status.CANCELLED


def test_worker_request_ids_name_the_attempt_the_prefill_try_and_the_path():
    attempt = Attempt("job", 2)
    assert attempt.worker_request_id == "job-2"
    attempt.path, attempt.prefill_try = Path.REMOTE, 1
    assert attempt.worker_request_id == "job-2-p1"
    attempt.path = Path.FALLBACK
    assert attempt.worker_request_id == "job-2-p1-local"
    attempt.path, attempt.prefill_try = Path.KV_LOST, 0
    assert attempt.worker_request_id == "job-2-kv"

"""The router checks a request against the limits its chosen decode worker registered."""

from __future__ import annotations

import pytest

from pdserve.engine.config import DEFAULT_MAX_N, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.validation import SamplingLimits
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router import worker_limits
from pdserve.services.router.config import RouterConfig
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.registration import worker_limits as registered


def info(**limits) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id="d0", role=pb.ROLE_DECODE, limits=pb.WorkerLimits(**limits))


@pytest.mark.parametrize("params, field", [
    (SamplingParams(n=5), "n"),
    (SamplingParams(beam_width=5, n=2), "beam_width"),
    (SamplingParams(logprobs=3), "logprobs"),
    (SamplingParams(prompt_logprobs=3), "prompt_logprobs"),
])
def test_a_request_over_a_registered_limit_is_refused_naming_the_field(params, field):
    with pytest.raises(ServeError) as info_:
        worker_limits.check(params, info(max_n=4, max_logprobs=2, max_num_seqs=64))
    error = info_.value
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message.startswith(f"{field}:") and "d0" in error.message, error.message


def test_max_num_seqs_bounds_the_sequences_a_request_runs():
    with pytest.raises(ServeError, match=r"^beam_width: runs 6 sequences"):
        worker_limits.check(SamplingParams(beam_width=6, n=2), info(max_n=8, max_num_seqs=4))


def test_within_the_limits_or_none_told_passes():
    worker_limits.check(SamplingParams(n=4, logprobs=2), info(max_n=4, max_logprobs=2, max_num_seqs=4))
    worker_limits.check(SamplingParams(n=64, logprobs=20), pb.WorkerInfo(worker_id="old"))  # nothing registered
    worker_limits.check(SamplingParams(n=64), info(max_logprobs=0))  # only what is told is checked
    with pytest.raises(ServeError, match=r"^logprobs: must be <= 0"):
        worker_limits.check(SamplingParams(logprobs=1), info(max_logprobs=0))  # 0 is a limit, not "unset"


def test_a_worker_registers_its_engines_limits():
    message = registered(SamplingLimits(4096, max_n=3, max_logprobs=5, max_num_seqs=16))
    assert (message.max_n, message.max_logprobs, message.max_num_seqs) == (3, 5, 16)
    assert not registered(SamplingLimits(4096)).HasField("max_num_seqs")


def test_max_n_has_one_default():
    assert EngineConfig(model="m").max_n == SamplingLimits(1).max_n == DEFAULT_MAX_N
    fields = {f.name: f.default for f in WorkerConfig.__dataclass_fields__.values()}
    assert fields["max_n"] == DEFAULT_MAX_N
    assert {f.name: f.default for f in RouterConfig.__dataclass_fields__.values()}["max_n"] == DEFAULT_MAX_N


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"the worker was asked {name} although the request is over its limits")


class _OneDecodeWorker:
    """A registry with one decode worker that registered max_n=2."""

    def __init__(self) -> None:
        self.handle = type("Handle", (), {})()
        self.handle.info = info(max_n=2)
        self.handle.worker_id, self.handle.role, self.handle.dropped = "d0", "decode", False
        self.handle.stub = _Untouchable()
        self.released = 0

    def acquire_decode(self, block_hashes, exclude):
        return None if exclude else self.handle

    def wait_for_decode(self, exclude, timeout):
        return False

    def release(self, handle):
        self.released += 1


def test_the_dispatcher_refuses_a_request_over_the_chosen_workers_max_n_before_calling_it():
    from pdserve.engine.llm import DEFAULT_MODEL
    from pdserve.services.common.deadline import Deadline
    from pdserve.services.common.metrics import Disabled
    from pdserve.services.router.cancel import Cancellation
    from pdserve.services.router.dispatch import Dispatcher
    from pdserve.services.router.validate import Job

    registry = _OneDecodeWorker()
    dispatcher = Dispatcher(registry, RouterConfig(model=DEFAULT_MODEL), Disabled())
    job = Job("r", "r", (1, 2, 3), SamplingParams(n=3), ())
    with pytest.raises(ServeError) as error:
        list(dispatcher.run(job, Deadline.after(5.0), Cancellation(), lambda n: None))
    assert error.value.status is Status.INVALID_ARGUMENT and error.value.message.startswith("n: must be <= 2")
    assert registry.released == 1

"""A request against the per-request limits a decode worker registered.

    worker --Register(WorkerInfo.limits: max_n, max_logprobs, max_num_seqs)--> router
    router: job validated against its own flags (validate.py), D chosen,
            check(job.params, D.info) -> ServeError(INVALID_ARGUMENT, naming the field)
            before anything is sent to D

A worker's limits are what it was started with, told once at registration, never a
convention the router assumes; a field it left unset (an older worker, a test's) is
not checked here, and the worker's own validation still refuses what it cannot serve.
Pure: no I/O, no state.
"""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams, check_field
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.status import ServeError, Status


def check(params: SamplingParams, info: pb.WorkerInfo) -> None:
    """Raise ServeError(INVALID_ARGUMENT), its message starting with the field's name,
    when the worker `info` registered a limit this request exceeds."""
    try:
        _check(params, info.limits)
    except ValueError as e:
        raise ServeError(Status.INVALID_ARGUMENT, f"{e} (decode worker {info.worker_id}'s registered limits)") from None


def _check(params: SamplingParams, limits: pb.WorkerLimits) -> None:
    if limits.HasField("max_n"):
        for name in ("n", "beam_width"):
            value = getattr(params, name)
            check_field(value <= limits.max_n, name, f"must be <= {limits.max_n} (max_n)", value)
    if limits.HasField("max_num_seqs"):
        name = "beam_width" if params.beam_width >= params.n else "n"
        check_field(params.num_seqs <= limits.max_num_seqs, name,
                    f"runs {params.num_seqs} sequences at once, more than max_num_seqs={limits.max_num_seqs}",
                    params.num_seqs)
    if limits.HasField("max_logprobs"):
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            check_field(value is None or value <= limits.max_logprobs, name,
                        f"must be <= {limits.max_logprobs} (max_logprobs)", value)

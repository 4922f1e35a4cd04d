"""Test doubles of the workers' RPC surface, for the router's unit tests only: a
worker handle whose stub answers Reserve, Prefill, Decode and Abort from a script,
and a registry that hands them out as services/router/registry.py does. No process,
no socket, no engine; the integration tests (tests/services, tests/cluster) run the
real ones.

    FakeWorker("d1", decode=[message, message, FAIL])   a Decode stream: its messages,
                                                        then (FAIL) UNAVAILABLE
    FakeWorker("p1", role=PREFILL, first=(7, -0.5))     Prefill answers that first token
    FakeWorker("d1", reserve=refusal(...))              Reserve fails with that error (a
                                                        refusal, in a script or as `first`,
                                                        fails that call likewise)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.engine.errors import FailureKind
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import ROLE_NAMES
from pdserve.services.common.failure import failure_metadata

DECODE = next(code for code, name in ROLE_NAMES.items() if name == "decode")
PREFILL = next(code for code, name in ROLE_NAMES.items() if name == "prefill")
FAIL = "fail"  # in a script: the call fails UNAVAILABLE here
BUSY = "busy"  # in a script: the call fails RESOURCE_EXHAUSTED here


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", metadata: tuple = ()) -> None:
        super().__init__(details)
        self._code, self._details, self._metadata = code, details, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._metadata


def refusal(code: grpc.StatusCode, details: str, kind: FailureKind | None = None) -> FakeRpcError:
    """A worker's failed call as its RPC handler ends it: a status, and the FailureKind
    in the trailing metadata when it names one."""
    return FakeRpcError(code, details, failure_metadata(kind) if kind is not None else ())


def _error(step: str | FakeRpcError) -> FakeRpcError:
    if isinstance(step, FakeRpcError):
        return step
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if step == BUSY else grpc.StatusCode.UNAVAILABLE
    return FakeRpcError(code, f"scripted {step}")


class FakeCall:
    """A Decode stream: the scripted messages, then the scripted failure, if any."""

    def __init__(self, script: Sequence) -> None:
        self.script = list(script)
        self.cancelled = False

    def __iter__(self):
        for step in self.script:
            if isinstance(step, (str, FakeRpcError)):
                raise _error(step)
            if self.cancelled:
                raise FakeRpcError(grpc.StatusCode.CANCELLED, "cancelled")
            yield step

    def cancel(self) -> None:
        self.cancelled = True


class _Future:
    def __init__(self, answer) -> None:
        self.answer = answer

    def result(self):
        if isinstance(self.answer, (str, FakeRpcError)):
            raise _error(self.answer)
        return self.answer

    def cancel(self) -> None:
        pass


@dataclass
class FakeStub:
    worker: FakeWorker

    def Decode(self, request: pb.DecodeRequest, timeout: float | None = None) -> FakeCall:
        self.worker.requests.append(request)
        if isinstance(self.worker.decode, (str, FakeRpcError)):
            raise _error(self.worker.decode)
        return FakeCall(self.worker.decode)

    def Reserve(self, request: pb.ReserveRequest, timeout: float | None = None) -> pb.ReserveResponse:
        self.worker.requests.append(request)
        if self.worker.reserve is not None:
            raise self.worker.reserve
        return pb.ReserveResponse(transfer_plan=b"plan")

    @property
    def Prefill(self) -> _Prefill:
        return _Prefill(self.worker)

    def Abort(self, request: pb.AbortRequest, timeout: float | None = None) -> pb.AbortResponse:
        self.worker.aborted.append(request.request_id)
        return pb.AbortResponse()


@dataclass
class _Prefill:
    worker: FakeWorker

    def future(self, request: pb.PrefillRequest, timeout: float | None = None) -> _Future:
        self.worker.requests.append(request)
        if self.worker.first is None:
            return _Future(FAIL)
        if isinstance(self.worker.first, FakeRpcError):
            return _Future(self.worker.first)
        token_id, logprob = self.worker.first
        return _Future(pb.PrefillResponse(first_token=pb.TokenLogprob(token_id=token_id, logprob=logprob)))


@dataclass(eq=False)
class FakeWorker:
    """A WorkerHandle as the dispatcher reads one (registry.py)."""

    worker_id: str
    decode: Sequence | str | FakeRpcError = ()  # Decode's script (a str or an error: the call itself fails so)
    role_code: int = DECODE
    kv: bool = False  # it moves KV (a decode worker reserves, a prefill worker ships)
    # Prefill's first token and its logprob (None: it fails UNAVAILABLE; an error: so)
    first: tuple[int, float] | FakeRpcError | None = None
    reserve: FakeRpcError | None = None  # Reserve fails so (None: it answers a plan)
    dropped: bool = False
    cached: set = field(default_factory=set)
    cached_lower: tuple = ()  # its KV tiers' hashes (host, disk): none
    requests: list = field(default_factory=list)  # every request it was sent, in order
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.info = pb.WorkerInfo(worker_id=self.worker_id, role=self.role_code,
                                  kv_endpoint="tcp://kv" if self.kv else "")
        self.stub = FakeStub(self)

    @property
    def role(self) -> str:
        return ROLE_NAMES[self.role_code]

    def decodes(self) -> list[pb.DecodeRequest]:
        return [r for r in self.requests if isinstance(r, pb.DecodeRequest)]


class FakeRegistry:
    """Hands out the decode workers in order (never one in `exclude`), the prefill
    workers likewise; counts bookings so a test can see every one released."""

    def __init__(self, decode: Iterable[FakeWorker], prefill: Iterable[FakeWorker] = ()) -> None:
        self.decode = list(decode)
        self.prefill = list(prefill)
        self.booked = 0

    def acquire_decode(self, block_hashes, exclude) -> FakeWorker | None:
        return self._book(next((w for w in self.decode if w not in exclude), None))

    def acquire_prefill(self, block_hashes, exclude: set[str]) -> FakeWorker | None:
        return self._book(next((w for w in self.prefill if w.worker_id not in exclude), None))

    def _book(self, worker: FakeWorker | None) -> FakeWorker | None:
        self.booked += worker is not None
        return worker

    def release(self, handle: FakeWorker) -> None:
        self.booked -= 1

    def wait_for_decode(self, exclude, timeout: float) -> bool:
        return False

    def no_remote_prefill(self) -> str | None:
        return None if self.prefill else "no_prefill_worker"

    def watch(self, handle: FakeWorker, on_drop):
        return lambda: None

    def probe_soon(self) -> None:
        pass


def tokens(index: int, token_ids: list[int], logprobs: list[float], finish: str = "") -> pb.SequenceDelta:
    return pb.SequenceDelta(index=index, token_ids=token_ids, token_logprobs=logprobs, finish_reason=finish)


def message(*deltas: pb.SequenceDelta) -> pb.DecodeResponse:
    return pb.DecodeResponse(deltas=list(deltas))


def final(*results: tuple[int, str, float], deltas: Sequence[pb.SequenceDelta] = (), cached: int = 0
          ) -> pb.DecodeResponse:
    """A worker's last message: (index, finish reason, cumulative logprob) per sequence."""
    return pb.DecodeResponse(deltas=list(deltas), finished=True, num_cached_tokens=cached, results=[
        pb.SequenceResult(index=i, finish_reason=reason, cumulative_logprob=cumulative)
        for i, reason, cumulative in results])

"""pdserve.v1.Worker for every role: dispatches each RPC to the role that serves it.

    role      Reserve  Prefill  Decode  Abort  Stats  Drain  KvEvents
    prefill     -        x        -       x      x      x       x
    decode      x        -        x       x      x      x       x
    mixed       x        x        x       x      x      x       x

An RPC the role does not serve answers UNIMPLEMENTED, naming the role. Reserve,
Prefill and Decode calls are counted while in flight (`busy`), so a draining worker
knows when stopping loses nothing; a KvEvents subscription (the router's, for as
long as it follows this worker) is not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import grpc

from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.errors import abort_unimplemented
from pdserve.services.common.stats import stats_response
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.kv_events import kv_event_stream

STATS_TIMEOUT = 5.0
MAX_DRAIN_GRACE = 3600.0


class PrefillRole(Protocol):
    """The prefill role's RPC (services/prefill/service.py)."""

    def prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse: ...


class DecodeRole(Protocol):
    """The decode role's RPCs (services/decode/service.py)."""

    def reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse: ...
    def decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.DecodeResponse]: ...


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self, config: WorkerConfig, loop: EngineLoop, prefill: PrefillRole | None, decode: DecodeRole | None,
        kv_stats: Callable[[], KVTransferStats] = KVTransferStats, drain: Callable[[float], tuple[bool, int]] | None = None,
        max_calls: int | None = None,
    ) -> None:
        """`max_calls`: Reserve, Prefill and Decode calls served at once; one more is
        refused with RESOURCE_EXHAUSTED, so that streams can never take the threads
        that Abort, Stats, Drain and KvEvents need (services/node.py)."""
        self.config = config
        self.loop = loop
        self.prefill_service = prefill
        self.decode_service = decode
        self.kv_stats = kv_stats  # the KV connector's counters (KVConnector.stats)
        self.drain = drain  # (grace seconds) -> (drained, remaining): the Worker's
        self.max_calls = max_calls
        self._calls = 0
        self._calls_lock = threading.Lock()

    @property
    def calls_in_flight(self) -> int:
        with self._calls_lock:
            return self._calls

    @contextmanager
    def _counted(self, context: grpc.ServicerContext, new: bool = True) -> Iterator[None]:
        """Count a call while it runs. A `new` one (Reserve, Prefill, a Decode that
        prefills itself) is refused when the calls running plus the reservations still
        waiting for their Decode call reach `max_calls`; a Decode that attaches to a
        reservation never is: its slot was taken when the reservation was granted."""
        with self._calls_lock:
            full = new and self.max_calls is not None and self._calls + self.loop.num_unattached >= self.max_calls
            if not full:
                self._calls += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"worker {self.config.id}: {self.max_calls} calls in flight (--grpc-threads)")
        try:
            yield
        finally:
            with self._calls_lock:
                self._calls -= 1

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        if self.decode_service is None:
            abort_unimplemented(context, "Reserve", self.config.role)
        with self._counted(context):
            return self.decode_service.reserve(request, context)

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        if self.prefill_service is None:
            abort_unimplemented(context, "Prefill", self.config.role)
        with self._counted(context):
            return self.prefill_service.prefill(request, context)

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.DecodeResponse]:
        if self.decode_service is None:
            abort_unimplemented(context, "Decode", self.config.role)
        # a Decode that carries the first token continues a request whose KV was lost (the
        # router's fallback): like an attach, it is no new work
        with self._counted(context, new=request.local_prefill and not request.HasField("first_token")):
            yield from self.decode_service.decode(request, context)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        if request.only_reserved:
            self.loop.abandon_reservation(request.request_id)
        else:
            self.loop.abort(request.request_id)
        return pb.AbortResponse()

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        try:
            stats = self.loop.stats(STATS_TIMEOUT, include_block_hashes=request.include_block_hashes)
        except TimeoutError as e:  # a long engine step: busy, not gone
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Stats: {e}")
        except RuntimeError as e:  # the engine thread has stopped
            context.abort(grpc.StatusCode.UNAVAILABLE, f"Stats: {e}")
        return stats_response(self.config.id, self.config.role, self.config.block_size, stats, self.kv_stats())

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        if self.drain is None:
            abort_unimplemented(context, "Drain", self.config.role)
        if not 0 <= request.grace_seconds <= MAX_DRAIN_GRACE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"grace_seconds: must be in [0, {MAX_DRAIN_GRACE:.0f}], got {request.grace_seconds}")
        drained, remaining = self.drain(request.grace_seconds)
        return pb.DrainResponse(drained=drained, remaining=remaining)

    def KvEvents(self, request: pb.KvEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.KvEventBatch]:
        yield from kv_event_stream(self.loop.engine.kv_events, request, context)

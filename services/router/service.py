"""pdserve.v1.Generation: the public API."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc

from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.auth import metadata_of
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import rpc_errors
from pdserve.services.common.write_guard import WriteGuard
from pdserve.services.router.admission import Admission
from pdserve.services.router.api_keys import ApiKeys
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import ClientGone, Dispatcher, RouterError
from pdserve.services.router.responses import ResponseBuilder
from pdserve.services.router.validate import Limits, Validator

log = logging.getLogger(__name__)
DEADLINE_TOLERANCE = 0.25  # seconds
RETRY_AFTER_KEY = "retry-after-ms"
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self, config: RouterConfig, limits: Limits, tokenizer: Tokenizer | None, dispatcher: Dispatcher,
        metrics: RouterMetrics, api_keys: ApiKeys | None = None,
    ) -> None:
        """Callers are authenticated before a call reaches here (api_keys.py);
        `api_keys` only names their tenant, with --salt-cache-by-key."""
        self.config = config
        self.api_keys = api_keys
        self.limits = limits
        self.tokenizer = tokenizer
        self.validator = Validator(limits, tokenizer)
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests, config.max_queue_wait)
        self.write_guard = WriteGuard(config.stream_write_timeout, "router", on_cut=metrics.stream_cut_off)
        self._inflight = 0
        self._idle = threading.Condition()
        self._closing = threading.Event()  # draining: admit nothing new
        self._cut = threading.Event()  # the drain's grace ran out: fail what is left

    def drain(self, grace: float) -> bool:
        """Admit no new request (UNAVAILABLE), let those in flight finish for up to
        `grace` seconds, then fail the rest with UNAVAILABLE (at their next message).
        True when nothing was left to fail."""
        self._closing.set()
        give_up = time.monotonic() + grace
        with self._idle:
            drained = self._idle.wait_for(lambda: self._inflight == 0, timeout=grace)
        if not drained:
            log.warning("router: %d requests left after a %.0fs drain: failing them", self._inflight, grace)
            self._cut.set()
            with self._idle:
                self._idle.wait_for(lambda: self._inflight == 0, timeout=max(1.0, give_up - time.monotonic()))
        return drained

    def _count(self, delta: int) -> None:
        with self._idle:
            self._inflight += delta
            if self._inflight == 0:
                self._idle.notify_all()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        """The request's messages; each write to the client is bounded by
        --stream-write-timeout (a client that stops reading is cut off, and the
        request aborted on its workers: they watch this call)."""
        return self.write_guard.guarded(self._generate(request, context), context, "Generate")

    def _generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        self.metrics.request_started()
        self._count(1)
        acquired = succeeded = False
        try:
            if self._closing.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "router: shutting down (draining), admitting no request")
            tenant = self._tenant(context)
            with rpc_errors(context):  # a bad request is refused before it waits for a slot
                job = self.validator.validate(request, tenant)
            deadline = Deadline.of_rpc(context, self.config.request_timeout)
            acquired = self.admission.acquire(deadline.remaining())
            if not acquired:
                self._refuse(context)
            builder = ResponseBuilder(job, self.tokenizer, arrival, self.metrics)
            try:
                for message in self.dispatcher.run(job, deadline, context, builder.note_cached_tokens):
                    if self._cut.is_set():
                        raise RouterError(grpc.StatusCode.UNAVAILABLE, "router: shut down before the request ended")
                    yield from builder.messages(message)
                succeeded = True
            except ClientGone:
                log.info("request %s: client gone, aborted on the workers", job.request_id)
            except RouterError as e:
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the workers are full: say when to retry
                    self._retry_hint(context)
                context.abort(e.code, e.message)
        finally:
            if acquired:
                self.admission.release()
            self.metrics.request_ended(None if succeeded else _failure(context))
            self._count(-1)

    def _refuse(self, context: grpc.ServicerContext) -> None:
        """RESOURCE_EXHAUSTED with when to retry, in trailing metadata: `retry-after-ms`
        and gRPC's own `grpc-retry-pushback-ms` (honoured by gRPC retry policies)."""
        ms = self._retry_hint(context)
        cfg = self.config
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"router: {cfg.max_concurrent_requests} requests in flight (--max-concurrent-requests) and "
                      f"{cfg.max_queued_requests} waiting (--max-queued-requests, --max-queue-wait "
                      f"{cfg.max_queue_wait:g}s); retry after {ms} ms")

    def _retry_hint(self, context: grpc.ServicerContext) -> str:
        ms = str(int(self.admission.retry_after() * 1000))
        context.set_trailing_metadata(((RETRY_AFTER_KEY, ms), (PUSHBACK_KEY, ms)))
        return ms

    def _tenant(self, context: grpc.ServicerContext) -> str | None:
        if not self.config.salt_cache_by_key or self.api_keys is None:
            return None
        tenant = self.api_keys.identify(metadata_of(context.invocation_metadata()))
        if tenant is None:  # the key was revoked since the interceptor let the call in
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "API key not valid")
        return tenant

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        lim = self.limits
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            name=lim.model_name, max_model_len=lim.max_model_len, vocab_size=lim.vocab_size, max_n=lim.max_n,
        )])


def _failure(context: grpc.ServicerContext) -> str:
    """The status a failed Generate ends with: the one it aborted with; for a call
    that ended under it, DEADLINE_EXCEEDED when its deadline had passed, else
    CANCELLED (the client went away); else UNKNOWN (an unexpected exception).
    The client's timer fires first and resets the stream, while the server's copy of
    the deadline (received as a timeout) lies later by the transit time: a call gone
    within DEADLINE_TOLERANCE of its deadline counts as DEADLINE_EXCEEDED."""
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code.name
    if context.is_active():
        return grpc.StatusCode.UNKNOWN.name
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= DEADLINE_TOLERANCE
    return (grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED).name

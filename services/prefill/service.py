"""The prefill role's RPC: Prefill.

    router --Prefill(tokens, sampling, target)--> here
      sender.start(target)          the connector learns where the pages go
      engine: prefill (export_kv)   pages leave layer by layer via engine.layer_hook
      first token sampled        -> PrefillResponse right away (TTFT)
      sender.finish(first_token)    final frame; the sender releases the blocks
                                    (a transfer that already failed: UNAVAILABLE,
                                    so the router tries another prefill worker)

Only the first token is sampled here (max_tokens=1); the decode worker checks it
against stop conditions when the KV is committed, and samples everything after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc

from pdserve.engine.engine import TokenDelta
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import delta_logprob, params_from_options
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import rpc_errors
from pdserve.services.decode.stream import POLL, failure_status
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import FailedEvent, FinishedEvent, RequestStream, TokenEvent
from pdserve.services.worker.kv_seam import KVSender, TransferTarget

CALL_TIMEOUT = 10.0


def first_token_params(params: SamplingParams) -> SamplingParams:
    """Sample exactly what the request's first token would be, and nothing more."""
    return dataclasses.replace(
        params, max_tokens=1, min_tokens=min(params.min_tokens, 1), n=1, beam_width=1, stop=(),
        prompt_logprobs=None, early_stopping=False,
    )


class PrefillService:
    def __init__(self, loop: EngineLoop, sender: KVSender | None, config: WorkerConfig) -> None:
        self.loop = loop
        self.sender = sender
        self.config = config

    def prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        if self.sender is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Prefill: this worker has no KV sender (--kv-connector)")
        deadline = Deadline.of_rpc(context, self.config.request_timeout)
        rid = request.request_id
        with rpc_errors(context):
            params = first_token_params(params_from_options(request.sampling, request.cache_salt))
            target = self._target(request, deadline)
            self._transfer(context, rid, "start", lambda: self.sender.start(target))
            try:
                stream = self.loop.submit(rid, list(request.token_ids), params, CALL_TIMEOUT, export_kv=True)
            except BaseException:
                self.sender.cancel(rid)
                raise
        first, output = self._wait(stream, context, deadline)
        self._transfer(context, rid, "finish",
                       lambda: self.sender.finish(rid, first.token_id if request.sample_first_token else None))
        response = pb.PrefillResponse(num_cached_tokens=output.num_cached_tokens)
        if request.sample_first_token:
            logprob = delta_logprob(first)
            response.first_token.CopyFrom(logprob or pb.TokenLogprob(token_id=first.token_id, logprob=first.logprob or 0.0))
        return response

    @staticmethod
    def _target(request: pb.PrefillRequest, deadline: Deadline) -> TransferTarget:
        t = request.target
        if not t.kv_endpoint:
            raise ValueError("target.kv_endpoint: must not be empty")
        return TransferTarget(
            request.request_id, t.worker_id, t.kv_endpoint, tuple(t.block_ids), t.num_cached_tokens, deadline.at,
            t.transfer_target, tuple(request.token_ids), request.cache_salt or None,
        )

    def _transfer(self, context: grpc.ServicerContext, rid: str, what: str, step: Callable[[], None]) -> None:
        """Run a sender step. A bad target is INVALID_ARGUMENT; a transfer that cannot go
        on (receiver unreachable, refused, failed) is UNAVAILABLE: another prefill
        worker, with a fresh reservation, may do better."""
        try:
            step()
        except ValueError as e:
            self.sender.cancel(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:
            self.sender.cancel(rid)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid!r}: KV transfer ({what}): {e}")

    def _wait(
        self, stream: RequestStream, context: grpc.ServicerContext, deadline: Deadline
    ) -> tuple[TokenDelta, RequestOutput]:
        """The first token and the finished output (one engine step apart at most)."""
        rid = stream.request_id
        first = None
        try:
            while True:
                if not context.is_active() or deadline.expired():
                    raise TimeoutError(f"request {rid!r}: cancelled or deadline passed during prefill")
                for event in stream.get(deadline.wait_step(POLL)):
                    if isinstance(event, TokenEvent):
                        first = first or event.delta
                    elif isinstance(event, FinishedEvent):
                        if first is None:  # finished with "abort": it can never fit here
                            self.sender.cancel(rid)
                            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          f"request {rid!r}: does not fit this worker's KV cache")
                        return first, event.output
                    elif isinstance(event, FailedEvent):
                        self.sender.cancel(rid)
                        context.abort(failure_status(event.failure), f"request {rid!r}: {event.message}")
        except TimeoutError as e:
            self.loop.abort(rid)
            self.sender.cancel(rid)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if deadline.expired() else grpc.StatusCode.CANCELLED, str(e))

"""The prefill role's RPC: Prefill.

    router --Prefill(tokens, sampling, plan)--> here
      the router's block hashes            checked once against ours (a mismatch:
                                           FAILED_PRECONDITION), then reused: the
                                           engine and the connector never rehash
      engine loop: start the plan          the KV connector learns where pages go
      engine: prefill (export_kv)          pages leave layer by layer (the layer hook)
      finished: final message, blocks held the first token goes with it if the plan
                                           says so (held until the receiver's ack)
      first token                       -> PrefillResponse right away (TTFT)
      (a transfer that failed: UNAVAILABLE, so the router tries another prefill worker;
       a decode worker whose pages are not ours: FAILED_PRECONDITION, naming what differs)

Only the first token is sampled here (max_tokens=1); the decode worker checks it
against stop conditions when the KV is committed, and samples everything after it.
The plan is the decode worker's (kvtransfer/plan.py), carried by the router unread;
whether the first token is used is in it.
"""

from __future__ import annotations

import dataclasses

import grpc

from pdserve.engine.engine import TokenDelta
from pdserve.engine.hashing import checked_block_hashes
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.wire import LayoutMismatch, TransferError
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import delta_logprob, params_from_options
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import rpc_errors
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import FailedEvent, Failure, FinishedEvent, RequestStream, TokenEvent
from pdserve.services.worker.rpc import CALL_TIMEOUT, POLL, abort_failed


def first_token_params(params: SamplingParams) -> SamplingParams:
    """Sample exactly what the request's first token would be, and nothing more."""
    return dataclasses.replace(
        params, max_tokens=1, min_tokens=min(params.min_tokens, 1), n=1, beam_width=1, stop=(),
        prompt_logprobs=None, early_stopping=False,
    )


class PrefillService:
    def __init__(self, loop: EngineLoop, config: WorkerConfig) -> None:
        self.loop = loop
        self.config = config

    def prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        if not self.loop.ships_kv:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Prefill: this worker has no KV sender (--kv-connector)")
        deadline = Deadline.of_rpc(context, self.config.request_timeout)
        rid = request.request_id
        with rpc_errors(context):
            params = first_token_params(params_from_options(request.sampling, request.cache_salt))
            plan = TransferPlan.unpack(request.transfer_plan)
            prompt = list(request.token_ids)
            hashes = checked_block_hashes(request.block_hashes, prompt, self.config.block_size, params.cache_salt)
            try:
                stream = self.loop.submit(rid, prompt, params, CALL_TIMEOUT, plan=plan, block_hashes=hashes)
            except TransferError as e:  # the receiver is out of reach: another prefill worker may do better
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid!r}: KV transfer (start): {e}")
            except LayoutMismatch as e:  # the pair's configurations differ: no request of theirs can pair
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"request {rid!r}: {e}")
        first, output = self._wait(stream, context, deadline)
        response = pb.PrefillResponse(num_cached_tokens=output.num_cached_tokens)
        if plan.sample_first_token:
            logprob = delta_logprob(first)
            response.first_token.CopyFrom(logprob or pb.TokenLogprob(token_id=first.token_id, logprob=first.logprob or 0.0))
        return response

    def _wait(
        self, stream: RequestStream, context: grpc.ServicerContext, deadline: Deadline
    ) -> tuple[TokenDelta, RequestOutput]:
        """The first token and the finished output (one engine step apart at most;
        the final message has gone out by then)."""
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
                            abort_failed(context, rid, Failure.NO_ROOM, "does not fit this worker's KV cache")
                        return first, event.output
                    elif isinstance(event, FailedEvent):
                        abort_failed(context, rid, event.failure, event.message)
        except TimeoutError as e:
            self.loop.abort(rid)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if deadline.expired() else grpc.StatusCode.CANCELLED, str(e))

"""The decode role's RPCs: Reserve and Decode.

    router --Reserve(prompt, hashes)--> here  the router's block hashes checked once
                                         against ours, then reused (never rehashed);
                                         blocks for the prompt (its cached prefix
                                         counted), the KV connector's transfer plan
                                         back to the router, for the prefill worker
    router --Decode(id)-------> here     the reserved request's stream: waits for its
                                         KV, then decodes (services/decode/stream.py)
    router --Decode(prompt, hashes, local_prefill)   the whole request here (no
                                         transfer); the hashes checked once, as Reserve's

A mismatch of the router's hashes (another tokenizer, block size or salt) is
FAILED_PRECONDITION with FailureKind BLOCK_HASH_MISMATCH in the trailing metadata
(services/common/errors.py), which the router fails the request by.

The reservation, its deadline (--reservation-timeout at most) and everything it
holds live in the engine loop's request table (services/worker/requests.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import grpc

from pdserve.engine.hashing import checked_block_hashes
from pdserve.engine.sampling_params import check_field
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import params_from_options
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import rpc_errors
from pdserve.services.common.write_guard import WriteGuard
from pdserve.services.decode.stream import DecodeStream
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import RequestStream
from pdserve.services.worker.rpc import CALL_TIMEOUT

log = logging.getLogger(__name__)


class DecodeService:
    def __init__(self, loop: EngineLoop, config: WorkerConfig) -> None:
        self.loop = loop
        self.config = config
        # A reader that stops reading (a router stuck behind its client) is cut off.
        self.write_guard = WriteGuard(config.stream_write_timeout, f"decode worker {config.id}",
                                      on_cut=loop.metrics.stream_cut_off)

    def reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        """Blocks for a prompt whose KV a prefill worker will send (P/D seam)."""
        if not self.loop.receives_kv:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Reserve: this worker has no KV receiver (--kv-connector)")
        with rpc_errors(context):
            lease = self._lease(request.timeout_seconds)
            params = params_from_options(request.sampling, request.cache_salt)
            prompt = list(request.token_ids)
            # The router's hashes, checked once here (a mismatch: FAILED_PRECONDITION),
            # then the engine and the connector use them: the prompt is hashed once.
            hashes = checked_block_hashes(request.block_hashes, prompt, self.config.block_size, params.cache_salt)
            reservation, plan = self.loop.reserve(request.request_id, prompt, params, lease, CALL_TIMEOUT,
                                                  block_hashes=hashes)
        return pb.ReserveResponse(num_cached_tokens=reservation.num_cached_tokens, transfer_plan=plan)

    def _lease(self, seconds: float) -> float:
        """The reservation's lifetime: the router's, at most --reservation-timeout (0:
        that). NaN or inf would make a reservation that never expires."""
        check_field(math.isfinite(seconds) and seconds >= 0, "timeout_seconds", "must be a finite number >= 0",
                    seconds)
        return min(seconds or self.config.reservation_timeout, self.config.reservation_timeout)

    def decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.DecodeResponse]:
        deadline = Deadline.of_rpc(context, self.config.request_timeout)
        rid = request.request_id
        with rpc_errors(context):
            if not rid:
                raise ValueError("request_id: must not be empty")
            if request.local_prefill:
                params = params_from_options(request.sampling, request.cache_salt)
                first = request.first_token if request.HasField("first_token") else None
                prompt = list(request.token_ids)
                hashes = checked_block_hashes(request.block_hashes, prompt, self.config.block_size, params.cache_salt)
                stream = self.loop.submit(rid, prompt, params, CALL_TIMEOUT, first_token=first, block_hashes=hashes)
            elif request.HasField("first_token"):
                raise ValueError("first_token: only with local_prefill")
            elif request.block_hashes:
                raise ValueError("block_hashes: only with local_prefill (a reservation has its prompt's)")
            else:
                stream = self._attach(rid, context)
        decode = DecodeStream(stream)
        try:
            yield from self.write_guard.guarded(decode.messages(self.loop, context, deadline), context, f"request {rid}")
        finally:
            # Cancelled, deadline passed, failed: free it (the request table stops the
            # KV receiver first). A finished request is freed already.
            if not decode.finished:
                self.loop.abort(rid)

    def _attach(self, rid: str, context: grpc.ServicerContext) -> RequestStream:
        try:
            return self.loop.attach(rid, CALL_TIMEOUT)
        except KeyError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))

"""pdserve.v1.Generation: the public gRPC API, a thin adapter over the front end.

    Generate(pb.GenerateRequest, context)
        request_of(pb, authorization metadata, the call's deadline) -> Request
                   (a sampling field refused: front_end.refuse -> INVALID_ARGUMENT)
        front_end.generate(Request) -> stream; context ends -> stream.cancel()
        each SequenceOutput -> response_of -> pb.GenerateResponse (write-guarded)
        ServeError -> context.abort(GRPC_CODES[status], message); with retry_after_s
                      the trailing metadata retry-after-ms and grpc-retry-pushback-ms
    ListModels -> the front end's limits
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NoReturn

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.auth import metadata_of
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import GRPC_CODES
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.common.status import ServeError
from pdserve.services.common.write_guard import WriteGuard
from pdserve.services.router.api_keys import AUTHORIZATION
from pdserve.services.router.frontend import FrontEnd
from pdserve.services.router.pb_records import request_of, response_of

RETRY_AFTER_KEY = "retry-after-ms"
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, front_end: FrontEnd, stream_write_timeout: float, metrics: RouterMetrics) -> None:
        self.front_end = front_end
        self.write_guard = WriteGuard(stream_write_timeout, "router", on_cut=metrics.stream_cut_off)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        """The request's messages; each write to the client is bounded by
        --stream-write-timeout (a client that stops reading is cut off, and the
        request aborted on its workers)."""
        return self.write_guard.guarded(self._generate(request, context), context, "Generate")

    def _generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        authorization = metadata_of(context.invocation_metadata()).get(AUTHORIZATION, "")
        try:
            front_request = request_of(request, authorization, Deadline.of_rpc(context, math.inf))
        except ValueError as e:  # a sampling field SamplingParams refused
            _abort(context, self.front_end.refuse(e))
        try:
            stream = self.front_end.generate(front_request)
        except ServeError as e:
            _abort(context, e)
        with stream:
            if not context.add_callback(stream.cancel):  # cancel, deadline or done: the workers stop
                stream.cancel()
            try:
                for output in stream:
                    yield response_of(output, stream.request_id)
            except ServeError as e:
                _abort(context, e)

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        lim = self.front_end.limits
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            name=lim.model_name, max_model_len=lim.max_model_len, vocab_size=lim.vocab_size, max_n=lim.max_n,
        )])


def _abort(context: grpc.ServicerContext, error: ServeError) -> NoReturn:
    """End the call with `error`'s status; a retry hint (RESOURCE_EXHAUSTED) goes in
    trailing metadata as `retry-after-ms` and gRPC's own `grpc-retry-pushback-ms`
    (honoured by gRPC retry policies)."""
    if error.retry_after_s is not None:
        ms = str(int(error.retry_after_s * 1000))
        context.set_trailing_metadata(((RETRY_AFTER_KEY, ms), (PUSHBACK_KEY, ms)))
    context.abort(GRPC_CODES[error.status], error.message)
    raise error  # not reached: abort raises

"""A request that is not a valid protobuf message is the caller's mistake.

grpcio answers a request it cannot deserialize with INTERNAL ("Exception
deserializing request!"), which tells a client the server broke. This interceptor,
on every pdserve server, makes it INVALID_ARGUMENT naming the message type instead:

    bytes --(request_deserializer raises)--> Malformed(type, error)
          --(handler sees Malformed)-------> abort(INVALID_ARGUMENT, "request: ...")

Only unary requests are covered (every pdserve RPC takes one message).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True)
class Malformed:
    what: str  # the method's name
    error: str


class MalformedRequests(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = _tolerant(handler.request_deserializer, details.method)
        if handler.response_streaming:
            return handler._replace(request_deserializer=deserialize, unary_stream=_refusing(handler.unary_stream))
        return handler._replace(request_deserializer=deserialize, unary_unary=_refusing(handler.unary_unary))


def _tolerant(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # protobuf's DecodeError, or anything a parser raises on garbage
            return Malformed(method, f"{type(e).__name__}")

    return parse


def _refusing(behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request: not a valid message for {request.what} ({request.error})")
        return behaviour(request, context)

    return handle

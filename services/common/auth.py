"""gRPC plumbing for credentials carried in call metadata, on both ends.

    server:  MetadataCheck(check, exempt)   an interceptor: `check(metadata)` returns
                                            None to let a call through, or the reason
                                            it is refused (UNAUTHENTICATED). A refused
                                            call never reaches its servicer, and its
                                            request is not even parsed.
    client:  with_metadata(channel, pairs)  a channel that adds `pairs` to every call

Comparisons of secrets go through `same_secret` (constant time).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping, Sequence

import grpc

Metadata = Mapping[str, str]
Check = Callable[[Metadata], "str | None"]
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes (a load balancer, a kubelet) carry no credentials
REFLECTION_PREFIX = "/grpc.reflection."


def same_secret(given: str | bytes, expected: str | bytes) -> bool:
    """Whether two secrets are equal, in time independent of their contents and of
    where they differ (digests first, so not even the length leaks)."""
    def digest(v: str | bytes) -> bytes:
        return hashlib.sha256(v.encode() if isinstance(v, str) else v).digest()

    return hmac.compare_digest(digest(given), digest(expected))


def metadata_of(pairs: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """Call metadata as a dict (text values only; a repeated key keeps its first value)."""
    out: dict[str, str] = {}
    for key, value in pairs or ():
        if isinstance(value, str):
            out.setdefault(key.lower(), value)
    return out


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that only aborts (the request stays unparsed)."""

    def refuse(_request: object, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class MetadataCheck(grpc.ServerInterceptor):
    """Refuse with UNAUTHENTICATED every call whose metadata `check` refuses, except
    calls to methods under one of the `exempt` prefixes."""

    def __init__(self, check: Check, exempt: Sequence[str] = (HEALTH_PREFIX,)) -> None:
        self.check = check
        self.exempt = tuple(exempt)

    def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.exempt):
            return handler
        reason = self.check(metadata_of(handler_call_details.invocation_metadata))
        if reason is None:
            return handler
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, reason)


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                    "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.pairs = tuple(pairs)

    def _details(self, d: grpc.ClientCallDetails) -> _Details:
        metadata = (*(d.metadata or ()), *self.pairs)
        return _Details(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def with_metadata(channel: grpc.Channel, pairs: Sequence[tuple[str, str]]) -> grpc.Channel:
    """`channel`, adding `pairs` to the metadata of every call made on it."""
    return grpc.intercept_channel(channel, _AddMetadata(pairs)) if pairs else channel

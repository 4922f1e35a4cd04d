"""Engine exceptions -> gRPC status codes, in one place.

    ValueError            INVALID_ARGUMENT   (the message names the field)
    NoCapacityError       RESOURCE_EXHAUSTED
    TimeoutError          DEADLINE_EXCEEDED
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.engine.errors import NoCapacityError

# Trailing metadata of a worker stream that failed: the worker's events.Failure value
# ("transfer", "expired", ...), so the router tells a lost KV transfer (it then has
# the decode worker prefill the prompt) from a worker in trouble.
FAILURE_METADATA = "pdserve-failure"


def status_of(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, NoCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


@contextmanager
def rpc_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Abort the RPC with the status matching an engine error raised in the block."""
    try:
        yield
    except (ValueError, NoCapacityError, TimeoutError) as e:
        context.abort(status_of(e), str(e))


def abort_unimplemented(context: grpc.ServicerContext, rpc: str, role: str) -> None:
    context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: a {role} worker does not serve it")

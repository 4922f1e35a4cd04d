"""What the roles' RPC handlers (services/prefill, services/decode) share."""

from __future__ import annotations

from typing import NoReturn

import grpc

from pdserve.services.common.failure import failure_metadata
from pdserve.services.worker.events import Failure

CALL_TIMEOUT = 10.0  # longest wait for the engine thread to take a command
POLL = 0.5  # seconds between checks that the caller is still there

_FAILURE_STATUS = {
    Failure.ABORTED: grpc.StatusCode.ABORTED,
    Failure.SHUTDOWN: grpc.StatusCode.UNAVAILABLE,
    Failure.EXPIRED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.TRANSFER: grpc.StatusCode.UNAVAILABLE,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
    Failure.NO_ROOM: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.BLOCK_HASH_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Failure.INVALID_CONSTRAINT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.CONSTRAINT_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def failure_status(failure: Failure) -> grpc.StatusCode:
    """The status a request that failed this way ends its RPC with."""
    return _FAILURE_STATUS[failure]


def abort_failed(context: grpc.ServicerContext, request_id: str, failure: Failure, message: str) -> NoReturn:
    """End the RPC of a request that failed: the failure's status, and its kind in the
    trailing metadata (services/common/failure.py), which its caller classifies by."""
    context.set_trailing_metadata(failure_metadata(failure))
    context.abort(failure_status(failure), f"request {request_id!r}: {message}")

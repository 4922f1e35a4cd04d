"""The project's statuses (status.py) <-> gRPC status codes, in one table.

    Status.X  <->  grpc.StatusCode.X       (the same canonical names)
    ValueError -> INVALID_ARGUMENT, NoCapacityError -> RESOURCE_EXHAUSTED,
    TimeoutError -> DEADLINE_EXCEEDED      (status.status_of)
    BlockHashMismatch -> FAILED_PRECONDITION, and FAILURE_KIND_BLOCK_HASH_MISMATCH in
                         the trailing metadata (failure.py): the router fails the
                         request by that kind, never mistaking it for another refusal
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.engine.errors import FailureKind, NoCapacityError
from pdserve.engine.hashing import BlockHashMismatch
from pdserve.services.common.failure import failure_metadata
from pdserve.services.common.status import Status, status_of

GRPC_CODES: dict[Status, grpc.StatusCode] = {
    Status.CANCELLED: grpc.StatusCode.CANCELLED,
    Status.UNKNOWN: grpc.StatusCode.UNKNOWN,
    Status.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Status.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Status.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Status.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Status.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Status.ABORTED: grpc.StatusCode.ABORTED,
    Status.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    Status.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    Status.INTERNAL: grpc.StatusCode.INTERNAL,
    Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Status.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
    Status.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
}
STATUSES: dict[grpc.StatusCode, Status] = {code: status for status, code in GRPC_CODES.items()}


def status_of_rpc(code: grpc.StatusCode) -> Status:
    """The status of a gRPC code a peer answered (OK has none: UNKNOWN)."""
    return STATUSES.get(code, Status.UNKNOWN)


@contextmanager
def rpc_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Abort the RPC with the status matching an engine error raised in the block
    (a block hash mismatch names its kind in the trailing metadata too)."""
    try:
        yield
    except (ValueError, NoCapacityError, TimeoutError) as e:
        if isinstance(e, BlockHashMismatch):
            context.set_trailing_metadata(failure_metadata(FailureKind.BLOCK_HASH_MISMATCH))
        context.abort(GRPC_CODES[status_of(e)], str(e))


def abort_unimplemented(context: grpc.ServicerContext, rpc: str, role: str) -> None:
    context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: a {role} worker does not serve it")

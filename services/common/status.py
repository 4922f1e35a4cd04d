"""The project's own error type: how a request ends, whatever carries it.

    ServeError(Status.INVALID_ARGUMENT, "max_tokens: must be >= 1, got 0")
    ServeError(Status.RESOURCE_EXHAUSTED, "...", retry_after_s=1.0)

`Status` holds the canonical status kinds (gRPC's codes, which Google's HTTP APIs
map too); each front end maps them to its framing in one table: gRPC in
services/common/errors.py, HTTP in its own adapter. Nothing here imports grpc, so
a front end that does not speak it, or the worker side, can raise these too.
"""

from __future__ import annotations

import enum

from pdserve.engine.errors import NoCapacityError
from pdserve.engine.hashing import BlockHashMismatch


class Status(enum.Enum):
    """Why a request ended without its answer. The name is what metrics record
    (`pdserve:request_failure_total{code=...}`)."""

    CANCELLED = "CANCELLED"  # the caller went away
    UNKNOWN = "UNKNOWN"  # an unexpected exception
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the message names the field
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # full: retry later (retry_after_s)
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"  # no worker could serve it (now), or the router is draining
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class ServeError(Exception):
    """End the request with `status` and `message` (shown to the caller as is).
    `retry_after_s`: when a refused caller should try again (RESOURCE_EXHAUSTED)."""

    def __init__(self, status: Status, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"ServeError({self.status.name}, {self.message!r}, retry_after_s={self.retry_after_s!r})"


def status_of(error: BaseException) -> Status:
    """The status of an engine exception.

        BlockHashMismatch     FAILED_PRECONDITION (a peer hashes prompts otherwise: tokenizer,
                              block size or salt; the message names the field)
        ValueError            INVALID_ARGUMENT   (the message names the field)
        NoCapacityError       RESOURCE_EXHAUSTED
        TimeoutError          DEADLINE_EXCEEDED
        ServeError            its own
        anything else         INTERNAL
    """
    if isinstance(error, ServeError):
        return error.status
    if isinstance(error, BlockHashMismatch):
        return Status.FAILED_PRECONDITION
    if isinstance(error, ValueError):
        return Status.INVALID_ARGUMENT
    if isinstance(error, NoCapacityError):
        return Status.RESOURCE_EXHAUSTED
    if isinstance(error, TimeoutError):
        return Status.DEADLINE_EXCEEDED
    return Status.INTERNAL

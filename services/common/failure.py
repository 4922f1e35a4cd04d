"""A request's FailureKind across a process boundary, mapped in one place.

    engine.errors.FailureKind.TRANSFER  <->  pb.FailureKind.FAILURE_KIND_TRANSFER
    a worker RPC that fails a request:   trailing metadata
                                         ("pdserve-failure-kind", "FAILURE_KIND_TRANSFER")
    the router:                          failure_of(rpc_error) -> FailureKind.TRANSFER

Why trailing metadata and not a response field: a failed RPC ends with a status and
no message (a unary call has no response at all, a stream only what it sent before
failing), so the kind travels with the status. The value is the proto enum value's
name, so it reads the same in any language's client; a missing, unknown or
UNSPECIFIED name is no kind (None).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.errors import FailureKind
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

FAILURE_METADATA = "pdserve-failure-kind"
_PREFIX = "FAILURE_KIND_"


def to_pb(kind: FailureKind) -> int:
    """The proto enum value of `kind` (pb.FailureKind)."""
    return pb.FailureKind.Value(_PREFIX + kind.name)


def from_pb(value: int) -> FailureKind | None:
    """The kind of a proto enum value; None for UNSPECIFIED or a value this build
    does not know (a newer peer's)."""
    try:
        name = pb.FailureKind.Name(value)
    except ValueError:
        return None
    return FailureKind.__members__.get(name.removeprefix(_PREFIX))


def wire_name(kind: FailureKind) -> str:
    """What the metadata and client-facing details carry: the proto enum value's name."""
    return pb.FailureKind.Name(to_pb(kind))


def failure_metadata(kind: FailureKind) -> tuple[tuple[str, str], ...]:
    """Trailing metadata telling a failed RPC's caller why."""
    return ((FAILURE_METADATA, wire_name(kind)),)


def kind_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> FailureKind | None:
    """The kind named by trailing metadata (None: none, or one this build does not know)."""
    for key, value in metadata or ():
        if key == FAILURE_METADATA and isinstance(value, str) and value in pb.FailureKind.keys():
            return from_pb(pb.FailureKind.Value(value))
    return None


def failure_of(error: BaseException) -> FailureKind | None:
    """The kind a failed worker call's trailing metadata names (None: none, or not a call's error)."""
    try:
        metadata = error.trailing_metadata()  # type: ignore[attr-defined]
    except AttributeError:  # not a call's error
        return None
    return kind_in(metadata)

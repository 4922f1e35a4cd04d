"""FailureKind across the process boundary: engine enum <-> proto enum <-> trailing metadata."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.errors import FailureKind
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.failure import (
    FAILURE_METADATA, failure_metadata, failure_of, from_pb, kind_in, to_pb, wire_name,
)
from pdserve.services.worker.events import Failure


@pytest.mark.parametrize("kind", list(FailureKind))
def test_every_kind_round_trips_through_the_proto_enum_and_the_metadata(kind: FailureKind):
    assert from_pb(to_pb(kind)) is kind
    assert wire_name(kind) == f"FAILURE_KIND_{kind.name}" == pb.FailureKind.Name(to_pb(kind))
    assert kind_in(failure_metadata(kind)) is kind


def test_the_proto_enum_has_exactly_the_engine_kinds_and_unspecified():
    names = {n.removeprefix("FAILURE_KIND_") for n in pb.FailureKind.keys()}
    assert names == {k.name for k in FailureKind} | {"UNSPECIFIED"}
    assert pb.FailureKind.Value("FAILURE_KIND_UNSPECIFIED") == 0


def test_unspecified_unknown_or_missing_is_no_kind():
    assert from_pb(0) is None
    assert from_pb(999) is None  # a newer peer's value
    assert kind_in(()) is None and kind_in(None) is None
    assert kind_in(((FAILURE_METADATA, "FAILURE_KIND_SOMETHING_NEW"),)) is None
    assert kind_in(((FAILURE_METADATA, "transfer"),)) is None  # the old free text is not a kind
    assert kind_in(((FAILURE_METADATA, "FAILURE_KIND_UNSPECIFIED"),)) is None
    assert kind_in((("other", "FAILURE_KIND_TRANSFER"),)) is None


def test_the_worker_failure_is_the_engine_kind():
    assert Failure is FailureKind


def test_only_transfer_and_expired_are_a_lost_kv():
    assert {k for k in FailureKind if k.kv_lost} == {FailureKind.TRANSFER, FailureKind.EXPIRED}


class _CallError(grpc.RpcError):
    def __init__(self, metadata):
        self._metadata = metadata

    def trailing_metadata(self):
        return self._metadata


def test_failure_of_reads_a_calls_trailing_metadata():
    assert failure_of(_CallError(failure_metadata(FailureKind.EXPIRED))) is FailureKind.EXPIRED
    assert failure_of(_CallError(None)) is None
    assert failure_of(ValueError("not a call")) is None


class _Context:
    """A servicer context that records the trailing metadata and raises its abort."""

    metadata = None

    def set_trailing_metadata(self, metadata):
        self.metadata = metadata

    def abort(self, code, details):
        raise RuntimeError(code, details)


def test_a_worker_rpc_that_fails_a_request_carries_its_kind_by_name():
    from pdserve.services.worker.rpc import abort_failed

    context = _Context()
    with pytest.raises(RuntimeError) as info:
        abort_failed(context, "r", FailureKind.EXPIRED, "reservation expired")
    assert info.value.args == (grpc.StatusCode.DEADLINE_EXCEEDED, "request 'r': reservation expired")
    assert context.metadata == ((FAILURE_METADATA, "FAILURE_KIND_EXPIRED"),)


@pytest.mark.parametrize("failure", list(FailureKind))
def test_every_kind_has_a_worker_status(failure: FailureKind):
    from pdserve.services.worker.rpc import failure_status

    assert isinstance(failure_status(failure), grpc.StatusCode)


def test_a_block_hash_mismatch_carries_its_kind_and_no_other_engine_error_does():
    from pdserve.engine.hashing import BlockHashMismatch
    from pdserve.services.common.errors import rpc_errors

    for error, code, metadata in [
        (BlockHashMismatch("block_hashes[0]: differs"), grpc.StatusCode.FAILED_PRECONDITION,
         ((FAILURE_METADATA, "FAILURE_KIND_BLOCK_HASH_MISMATCH"),)),
        (ValueError("block_hashes[0]: 1 bytes"), grpc.StatusCode.INVALID_ARGUMENT, None),
    ]:
        context = _Context()
        with pytest.raises(RuntimeError) as info, rpc_errors(context):
            raise error
        assert info.value.args == (code, str(error)) and context.metadata == metadata

"""A worker checks the router's block hashes once (Reserve, Prefill, a Decode that
carries its prompt), then passes them down; a mismatch or a hostile list is refused
with a status naming the field, a mismatch with its FailureKind in the trailing
metadata."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from pdserve.engine.disagg import Reservation
from pdserve.engine.errors import FailureKind
from pdserve.engine.hashing import hash_blocks
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.failure import kind_in
from pdserve.services.decode.service import DecodeService
from pdserve.services.prefill.service import PrefillService

PROMPT = list(range(3, 40))  # two full blocks of 16
OPTIONS = pb.SamplingOptions(max_tokens=4, temperature=0.0)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    def __init__(self) -> None:
        self.metadata = None

    def abort(self, code, details):
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata):
        self.metadata = metadata

    def time_remaining(self):
        return None

    def is_active(self):
        return True


class Loop:
    """What the services call on the engine loop: records the hashes it is given."""

    receives_kv = ships_kv = True

    def __init__(self) -> None:
        self.hashes: list[bytes] | None = None

    def reserve(self, request_id, prompt, params, lease, timeout, block_hashes=()):
        self.hashes = list(block_hashes)
        return Reservation(request_id, [0, 1, 2], 0, tuple(block_hashes)), b"plan"

    def submit(self, request_id, prompt, params, timeout, *, plan=None, block_hashes=(), **_):
        self.hashes = list(block_hashes)
        raise ValueError("submitted (the test stops here)")


CONFIG = SimpleNamespace(block_size=16, reservation_timeout=30.0, request_timeout=60.0, stream_write_timeout=10.0,
                         id="decode-t")


def decode_service(loop: Loop) -> DecodeService:
    service = DecodeService.__new__(DecodeService)  # no write guard: the tests end before any stream
    service.loop, service.config = loop, CONFIG
    return service


def reserve(hashes, context: Context | None = None) -> tuple[Loop, pb.ReserveResponse]:
    loop = Loop()
    request = pb.ReserveRequest(request_id="r", token_ids=PROMPT, sampling=OPTIONS, block_hashes=hashes)
    return loop, decode_service(loop).reserve(request, context or Context())


def decode(hashes, context: Context | None = None, loop: Loop | None = None, **fields) -> Loop:
    """A local-prefill Decode carrying `hashes`: the fake loop refuses once it has them
    (the test stops there), so this always raises Aborted."""
    loop = loop or Loop()
    request = pb.DecodeRequest(request_id="d", local_prefill=True, token_ids=PROMPT, sampling=OPTIONS,
                               block_hashes=hashes, **fields)
    list(decode_service(loop).decode(request, context or Context()))
    return loop


def test_matching_hashes_are_passed_down_as_they_are():
    ours = hash_blocks(PROMPT, 16)
    loop, response = reserve(ours)
    assert loop.hashes == ours and response.transfer_plan == b"plan"
    loop, _ = reserve([])  # none sent: hashed here, once
    assert loop.hashes == ours


RPCS = {"reserve": reserve, "decode": decode}


@pytest.mark.parametrize("rpc", RPCS)
def test_a_mismatch_is_failed_precondition_naming_the_field_the_causes_and_the_kind(rpc):
    context = Context()
    with pytest.raises(Aborted) as info:
        RPCS[rpc](hash_blocks(PROMPT, 16, cache_salt="another tenant"), context)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details.startswith("block_hashes[0]:") and "block size" in info.value.details
    assert kind_in(context.metadata) is FailureKind.BLOCK_HASH_MISMATCH


@pytest.mark.parametrize("rpc", RPCS)
@pytest.mark.parametrize("hashes, code, start, kind", [
    ([b"\x00" * 32], grpc.StatusCode.FAILED_PRECONDITION, "block_hashes: 1 hashes", FailureKind.BLOCK_HASH_MISMATCH),
    ([b"\x00" * 32] * 3, grpc.StatusCode.FAILED_PRECONDITION, "block_hashes: 3 hashes",
     FailureKind.BLOCK_HASH_MISMATCH),
    ([b"\x00" * 32, b"\x01"], grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[1]: 1 bytes", None),
    ([b"\x00" * 64, b"\x00" * 32], grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[0]: 64 bytes", None),
])
def test_hostile_hash_lists_are_refused_naming_the_field(rpc, hashes, code, start, kind):
    context = Context()
    with pytest.raises(Aborted) as info:
        RPCS[rpc](hashes, context)
    assert info.value.code == code and info.value.details.startswith(start), info.value.details
    assert kind_in(context.metadata) is kind  # a malformed list is the sender's bug, not a mismatch


def test_a_local_prefill_decode_checks_once_and_passes_them_down():
    ours = hash_blocks(PROMPT, 16)
    for sent in (ours, []):  # none sent: hashed here, once
        loop = Loop()
        with pytest.raises(Aborted) as info:
            decode(sent, loop=loop)
        assert info.value.details == "submitted (the test stops here)" and loop.hashes == ours
    loop = Loop()  # the fallback after a lost transfer carries the first token and the hashes alike
    with pytest.raises(Aborted):
        decode(ours, loop=loop, first_token=5)
    assert loop.hashes == ours
    loop = Loop()
    with pytest.raises(Aborted):
        decode(ours[:1], loop=loop)
    assert loop.hashes is None  # refused before the engine saw it


def test_a_decode_of_a_reservation_carries_no_hashes():
    loop = Loop()
    request = pb.DecodeRequest(request_id="d", block_hashes=hash_blocks(PROMPT, 16))
    with pytest.raises(Aborted) as info:
        list(decode_service(loop).decode(request, Context()))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("block_hashes: only with local_prefill")


def test_the_prefill_worker_checks_once_and_passes_them_down(monkeypatch):
    from pdserve.services.prefill import service as prefill_service

    monkeypatch.setattr(prefill_service.TransferPlan, "unpack", staticmethod(lambda data: SimpleNamespace()))
    loop = Loop()
    service = PrefillService(loop, CONFIG)
    ours = hash_blocks(PROMPT, 16)
    request = pb.PrefillRequest(request_id="p", token_ids=PROMPT, sampling=OPTIONS, block_hashes=ours)
    with pytest.raises(Aborted) as info:  # the fake loop refuses once it has the hashes
        service.prefill(request, Context())
    assert info.value.details == "submitted (the test stops here)" and loop.hashes == ours
    del request.block_hashes[:]
    request.block_hashes.extend(hash_blocks(PROMPT, 16, cache_salt="x"))
    loop.hashes = None
    context = Context()
    with pytest.raises(Aborted) as info:
        service.prefill(request, context)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and loop.hashes is None
    assert kind_in(context.metadata) is FailureKind.BLOCK_HASH_MISMATCH

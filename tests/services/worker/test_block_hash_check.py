"""A worker checks the router's block hashes once (Reserve, Prefill), then passes them
down; a mismatch or a hostile list is refused with a status naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from pdserve.engine.disagg import Reservation
from pdserve.engine.hashing import hash_blocks
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.decode.service import DecodeService
from pdserve.services.prefill.service import PrefillService

PROMPT = list(range(3, 40))  # two full blocks of 16
OPTIONS = pb.SamplingOptions(max_tokens=4, temperature=0.0)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata):
        pass

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


def reserve(hashes) -> tuple[Loop, pb.ReserveResponse]:
    loop = Loop()
    service = DecodeService.__new__(DecodeService)  # no write guard needed for Reserve
    service.loop, service.config = loop, CONFIG
    request = pb.ReserveRequest(request_id="r", token_ids=PROMPT, sampling=OPTIONS, block_hashes=hashes)
    return loop, service.reserve(request, Context())


def test_matching_hashes_are_passed_down_as_they_are():
    ours = hash_blocks(PROMPT, 16)
    loop, response = reserve(ours)
    assert loop.hashes == ours and response.transfer_plan == b"plan"
    loop, _ = reserve([])  # none sent: hashed here, once
    assert loop.hashes == ours


def test_a_mismatch_is_failed_precondition_naming_the_field_and_the_causes():
    with pytest.raises(Aborted) as info:
        reserve(hash_blocks(PROMPT, 16, cache_salt="another tenant"))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details.startswith("block_hashes[0]:") and "block size" in info.value.details


@pytest.mark.parametrize("hashes, code, start", [
    ([b"\x00" * 32], grpc.StatusCode.FAILED_PRECONDITION, "block_hashes: 1 hashes"),
    ([b"\x00" * 32] * 3, grpc.StatusCode.FAILED_PRECONDITION, "block_hashes: 3 hashes"),
    ([b"\x00" * 32, b"\x01"], grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[1]: 1 bytes"),
    ([b"\x00" * 64, b"\x00" * 32], grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[0]: 64 bytes"),
])
def test_hostile_hash_lists_are_refused_naming_the_field(hashes, code, start):
    with pytest.raises(Aborted) as info:
        reserve(hashes)
    assert info.value.code == code and info.value.details.startswith(start), info.value.details


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
    with pytest.raises(Aborted) as info:
        service.prefill(request, Context())
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and loop.hashes is None

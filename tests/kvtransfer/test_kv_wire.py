"""kvtransfer/wire.py: the frame format alone (pure: no receiver, no state): headers
round-trip, malformed ones are refused with a reason, page layouts describe an engine
tensor and travel with their format. What a receiver does with a message:
test_kv_inbox.py."""

from __future__ import annotations

import msgpack
import pytest
import torch

from pdserve.kvtransfer.wire import (
    VERSION,
    AbortHeader,
    AckHeader,
    FinalHeader,
    HelloHeader,
    PageLayout,
    PagesHeader,
    WelcomeHeader,
    WireError,
    decode,
    encode,
    message_mac,
    new_secret,
    prompt_digest,
    proves,
    sign,
)

LAYOUT = PageLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
PAGE = LAYOUT.page_bytes  # 512
DIGEST = prompt_digest(list(range(3, 21)))
SECRET = b"s" * 32
FP8 = ("float8_e4m3fn", "float8_e5m2")


# -- headers -----------------------------------------------------------------------


@pytest.mark.parametrize("header", [
    sign(PagesHeader("r", 3, 1, ((1, 2), (5, 1)), (2 * PAGE, PAGE), "bfloat16", (4, 2, 8), "p2p"), SECRET),
    sign(FinalHeader("r", 4, 18, DIGEST, (7,)), SECRET),
    sign(FinalHeader("r", 0, 1, DIGEST, ()), SECRET),
    sign(FinalHeader("r", 2, 18, DIGEST, (7,), (3, 1000, "bfloat16")), SECRET),
    sign(AbortHeader("r", "out of memory"), SECRET),
    AckHeader("r", False, "deadline exceeded"),
    HelloHeader("abc"),
    WelcomeHeader("abc", "127.0.0.1", 4242, 1),
])
def test_headers_round_trip(header):
    assert decode(encode(header)) == header


def _raw(**fields) -> bytes:
    base = {"v": VERSION, "kind": "pages", "rid": "r", "seq": 0, "layer": 0, "runs": [[1, 1]],
            "nbytes": [PAGE], "dtype": "float32", "page": [4, 2, 8], "via": "frames", "mac": b"m" * 32}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...}, use_bin_type=True)


@pytest.mark.parametrize("raw, reason", [
    (b"", "bad_header"),
    (b"\xc1garbage", "bad_header"),
    (msgpack.packb([1, 2, 3]), "bad_header"),
    (b"\x00" * (1 << 17), "oversized"),
    (_raw(v=1), "bad_version"),  # before reservation secrets
    (_raw(v=2), "bad_version"),  # before EAGLE head state in final messages
    (_raw(v=4), "bad_version"),
    (_raw(v=0), "bad_version"),
    (_raw(v="1"), "bad_version"),
    (_raw(v=True), "bad_version"),
    (_raw(v=...), "bad_version"),
    (_raw(kind="pickle"), "bad_kind"),
    (_raw(kind=7), "bad_kind"),
    (_raw(rid=""), "bad_header"),
    (_raw(rid="x" * 300), "bad_header"),
    (_raw(rid=b"r"), "bad_header"),
    (_raw(seq=-1), "bad_header"),
    (_raw(seq=True), "bad_header"),
    (_raw(seq=1.0), "bad_header"),
    (_raw(layer=...), "bad_header"),
    (_raw(runs=[]), "bad_header"),
    (_raw(runs=[[1]]), "bad_header"),
    (_raw(runs=[[1, 0]]), "bad_header"),
    (_raw(runs=[[-1, 1]]), "bad_header"),
    (_raw(runs="1,1"), "bad_header"),
    (_raw(nbytes=[PAGE, PAGE]), "bad_header"),
    (_raw(nbytes=[]), "bad_length"),
    (_raw(page=[4, 2]), "bad_header"),
    (_raw(via="pickle"), "bad_header"),
    (_raw(mac=...), "bad_header"),
    (_raw(mac=b"m" * 31), "bad_header"),
    (_raw(mac="m" * 32), "bad_header"),
    (msgpack.packb({"v": VERSION, "kind": "final", "rid": "r", "seq": 0, "num_tokens": 3, "digest": b"short", "first": [],
                    "mac": b"m" * 32}), "bad_header"),
    (msgpack.packb({"v": VERSION, "kind": "final", "rid": "r", "seq": 0, "num_tokens": 3, "digest": DIGEST,
                    "first": list(range(17)), "mac": b"m" * 32}), "bad_header"),
    (msgpack.packb({"v": VERSION, "kind": "final", "rid": "r", "seq": 0, "num_tokens": 3, "digest": DIGEST, "first": []}),
     "bad_header"),
    (msgpack.packb({"v": VERSION, "kind": "final", "rid": "r", "seq": 0, "num_tokens": 3, "digest": DIGEST, "first": [],
                    "mac": b"m" * 32}), "bad_header"),  # no draft key
    (msgpack.packb({"v": VERSION, "kind": "final", "rid": "r", "seq": 0, "num_tokens": 3, "digest": DIGEST, "first": [],
                    "draft": [0, 0, "float32"], "mac": b"m" * 32}), "bad_header"),  # an empty state
    (msgpack.packb({"v": VERSION, "kind": "final", "rid": "r", "seq": 0, "num_tokens": 3, "digest": DIGEST, "first": [],
                    "draft": [0, 8], "mac": b"m" * 32}), "bad_header"),
    (msgpack.packb({"v": VERSION, "kind": "abort", "rid": "r", "reason": "x"}), "bad_header"),
    (msgpack.packb({"v": VERSION, "kind": "ack", "rid": "r", "ok": 1, "reason": ""}), "bad_header"),
    (msgpack.packb({1: 2}), "bad_header"),
])
def test_decode_refuses_malformed_headers(raw, reason):
    with pytest.raises(WireError) as info:
        decode(raw)
    assert info.value.reason == reason


def test_page_layout_of_an_engine_tensor():
    kv = torch.zeros((3, 7, 2, 16, 2, 8), dtype=torch.bfloat16)
    layout = PageLayout.of(kv)
    assert layout == PageLayout(3, 16, 2, 8, "bfloat16") and layout.page_bytes == 2 * 16 * 2 * 8 * 2
    assert PageLayout.from_wire(layout.to_wire()) == layout
    with pytest.raises(ValueError, match="kv_cache"):
        PageLayout.of(torch.zeros(3, 7, 3, 16, 2, 8))
    with pytest.raises(ValueError, match="dtype"):
        PageLayout(1, 1, 1, 1, "int8")


def test_fp8_pages_are_a_quarter_of_float32_and_half_of_float16():
    shape = (4, 16, 4, 32)
    f32, f16 = PageLayout(*shape, "float32"), PageLayout(*shape, "float16")
    for dtype in FP8:
        fp8 = PageLayout(*shape, dtype)
        assert fp8.page_bytes == 2 * 16 * 4 * 32 == f32.page_bytes // 4 == f16.page_bytes // 2


@pytest.mark.parametrize("dtype", FP8)
def test_layout_of_an_fp8_cache_round_trips_with_its_format(dtype):
    kv = torch.zeros((3, 5, 2, 8, 2, 4), dtype=getattr(torch, dtype))
    layout = PageLayout.of(kv, "weights=int8/online;kv_scales=0123456789abcdef")
    assert layout == PageLayout(3, 8, 2, 4, dtype, "weights=int8/online;kv_scales=0123456789abcdef")
    assert layout.page_bytes == 2 * 8 * 2 * 4
    assert PageLayout.from_wire(layout.to_wire()) == layout
    assert PageLayout.from_wire({**layout.to_wire(), "format": ""}) != layout  # the format is part of equality
    with pytest.raises(ValueError, match="layout.format"):  # a plan that does not say what its pages mean
        PageLayout.from_wire({k: v for k, v in layout.to_wire().items() if k != "format"})
    with pytest.raises(ValueError, match="kv_format"):
        PageLayout(3, 8, 2, 4, dtype, "x" * 1000)


def test_a_signature_proves_the_secret_and_every_field():
    header = PagesHeader("r", 0, 1, ((1, 2),), (2 * PAGE,), "float32", (4, 2, 8))
    signed = sign(header, SECRET)
    assert proves(signed, SECRET) and not proves(signed, b"t" * 32)
    assert signed.mac == message_mac(SECRET, header)  # the mac is not part of what it covers
    moved = PagesHeader("r", 0, 1, ((2, 2),), (2 * PAGE,), "float32", (4, 2, 8), mac=signed.mac)
    assert not proves(moved, SECRET)  # another position, same mac: refused
    assert len(new_secret()) == 32 and new_secret() != new_secret()


def test_the_prompt_digest_names_the_whole_prompt():
    assert prompt_digest([1, 2, 3]) == prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    assert prompt_digest([1, 2]) != prompt_digest([1, 2, 0])
    with pytest.raises(ValueError, match="token_ids"):
        prompt_digest([-1])

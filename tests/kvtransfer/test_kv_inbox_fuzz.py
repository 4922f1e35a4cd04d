"""Hypothesis, time-bounded: mutated KV frames (issue 13). Valid messages with bytes
flipped, cut, spliced or repeated, and small frames that declare huge msgpack
containers, only ever raise the wire's own `WireError`, never allocate more than a
few MB, and never write outside the reservation. (test_kv_inbox.py builds messages
field by field; this one breaks them byte by byte.)"""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.inbox import deliver
from pdserve.kvtransfer.wire import MAX_HEADER_BYTES, WireError, decode
from test_kv_inbox import PAGE, PEER, ListFrames, abort, final, make_inbox, pages, untouched

FUZZ = settings(deadline=None, max_examples=300, suppress_health_check=list(HealthCheck))
# Most a header frame (<= 64 KiB) may cost to parse; a parser that trusted a declared
# length (an array of 2**32 items in 5 bytes) would blow far past it.
MAX_PARSE_BYTES = 8 << 20


def valid_messages() -> list[list[bytes]]:
    return [pages("r", 0, 0, [(1, 3), (4, 1)]), final("r", 3), abort("r", "gone")]


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """`data` after a few byte-level edits."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "repeat", "set"]))
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if op == "flip" and out:
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and out:
            out[at] = draw(st.sampled_from([0x00, 0xc1, 0xdc, 0xdd, 0xde, 0xdf, 0xc6, 0xdb, 0xff, 0x7f]))
        elif op == "cut":
            del out[at: at + draw(st.integers(1, 16))]
        elif op == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "repeat":
            out[at:at] = out[at: at + draw(st.integers(1, 32))] * draw(st.integers(1, 64))
    return bytes(out)


# Frames that declare far more than they hold: arrays, maps, strings and bins of
# 2**16 / 2**32 items or bytes, nested.
BOMBS = st.builds(
    lambda head, n: head * n,
    st.sampled_from([b"\xdc\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xde\xff\xff", b"\xdf\xff\xff\xff\xff",
                     b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\x81\xa1v\xdd\x00\x01\x00\x00"]),
    st.integers(1, 20_000),
)


def _parse_cost(raw: bytes) -> int:
    """Peak bytes Python allocated while decoding `raw`; decoding must only ever
    return a header or raise WireError."""
    tracemalloc.start()
    try:
        try:
            decode(raw)
        except WireError:
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@FUZZ
@given(data=st.data(), which=st.integers(0, 2))
def test_mutated_headers_raise_only_wire_errors_and_cost_little(data, which):
    header = valid_messages()[which][0]
    raw = data.draw(mutated(header))
    assert _parse_cost(raw) < MAX_PARSE_BYTES


@settings(deadline=None, max_examples=60, suppress_health_check=list(HealthCheck))
@given(raw=BOMBS)
def test_frames_declaring_huge_containers_cost_little(raw):
    raw = raw[:MAX_HEADER_BYTES + 16]
    assert _parse_cost(raw) < MAX_PARSE_BYTES


@FUZZ
@given(data=st.data(), which=st.integers(0, 2), part=st.integers(0, 8))
def test_mutated_messages_never_escape_the_reservation(data, which, part):
    """Any frame of a valid message mutated (header or page bytes), or frames
    dropped or repeated: refused with WireError, or accepted; nothing lands outside
    the reserved blocks, and the reservation ends at most once."""
    inbox = make_inbox()
    before = inbox.kv.clone()
    frames = list(valid_messages()[which])
    at = part % len(frames)
    edit = data.draw(st.sampled_from(["mutate", "drop", "repeat", "resize"]))
    if edit == "mutate":
        frames[at] = data.draw(mutated(frames[at]))
    elif edit == "drop":
        del frames[at]
    elif edit == "repeat":
        frames.insert(at, frames[at])
    else:
        frames[at] = frames[at][: data.draw(st.integers(0, 2 * PAGE))] + b"\x01" * data.draw(st.integers(0, PAGE))
    try:
        deliver(inbox, PEER, ListFrames(frames))
    except WireError as exc:
        inbox.reject(exc.reason)
    assert untouched(inbox.kv, before)
    events = inbox.take_events()
    assert [e.request_id for e in events] in ([], ["r"])
    assert len(inbox.pending()) + len(events) == 1


def test_a_bomb_is_refused_for_its_declared_size():
    """What keeps the parse cheap: a 4-billion-item array in 15 bytes is refused for
    its declared length, not read item by item."""
    with pytest.raises(ValueError, match="exceeds"):
        msgpack.unpackb(b"\xdd\xff\xff\xff\xff" * 3)
    with pytest.raises(WireError, match="bad_header"):
        decode(b"\xdd\xff\xff\xff\xff" * 3)

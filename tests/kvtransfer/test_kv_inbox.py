"""kvtransfer/inbox.py: the receiver's acceptance rules, without sockets: a message is
accepted, refused with a counted reason, or fails its transfer, and no sequence of
messages, however wrong, writes outside the reserved blocks of its request (the frame
format alone: test_kv_wire.py)."""

from __future__ import annotations

import threading

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.spec.draft_state import DraftLayout
from pdserve.kvtransfer.inbox import Inbox, deliver
from pdserve.kvtransfer.transfer import Transfer
from pdserve.kvtransfer.wire import (
    VERSION,
    AbortHeader,
    FinalHeader,
    HelloHeader,
    PageLayout,
    PagesHeader,
    WireError,
    decode,
    encode,
    new_secret,
    prompt_digest,
    sign,
)

LAYOUT = PageLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
PAGE = LAYOUT.page_bytes  # 512
NUM_BLOCKS = 16
PEER = b"peer-1"
# The reservation every test uses: prompt blocks 0..4 live in these (non-consecutive)
# blocks; block index 0 is the decoder's own prefix-cache hit (skip = 1).
RESERVED = (9, 3, 4, 5, 12)
SKIP = 1
PROMPT = list(range(3, 21))  # 18 tokens -> 5 blocks of 4
DIGEST = prompt_digest(PROMPT)
SECRET = b"s" * 32  # the reservation's secret, known to the sender the router chose
# Blocks no message may ever write: everything but the reserved, uncached ones.
FORBIDDEN = torch.tensor([b for b in range(NUM_BLOCKS) if b not in RESERVED[SKIP:]])


class ListFrames:
    """A FrameSource over a list of frames, with ZeroMQ's recv_into semantics."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = list(frames)

    def more(self) -> bool:
        return bool(self.frames)

    def next_frame(self) -> bytes:
        return self.frames.pop(0)

    def recv_into(self, buf: memoryview) -> int:
        frame = self.frames.pop(0)
        n = min(len(frame), len(buf))
        buf[:n] = frame[:n]
        return len(frame)


def make_kv() -> torch.Tensor:
    shape = (LAYOUT.num_layers, NUM_BLOCKS, *LAYOUT.page_shape)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * -1.0


def make_inbox() -> Inbox:
    inbox = Inbox(make_kv())
    inbox.expect(Transfer("r", RESERVED, SKIP, len(PROMPT), DIGEST, SECRET))
    return inbox


def page_bytes(layer: int, index: int, count: int = 1) -> bytes:
    """Recognisable content for pages [index, index + count) of `layer`."""
    n = PAGE // 4
    return b"".join(
        (torch.arange(n, dtype=torch.float32) + 1000 * layer + 100 * i).numpy().tobytes()
        for i in range(index, index + count)
    )


def pages(rid: str, seq: int, layer: int, runs, frames=None, secret: bytes = SECRET, **overrides) -> list[bytes]:
    header = PagesHeader(rid, seq, layer, tuple(runs), tuple(c * PAGE for _, c in runs),
                         LAYOUT.dtype, LAYOUT.wire_page)
    fields = {**header.__dict__, **overrides}
    header = PagesHeader(**fields)
    if frames is None:
        frames = [page_bytes(layer, f, c) for f, c in runs]
    return [encode(sign(header, secret)), *frames]


def final(rid: str, seq: int, digest: bytes = DIGEST, num_tokens: int = len(PROMPT), first=(7,),
          secret: bytes = SECRET) -> list[bytes]:
    return [encode(sign(FinalHeader(rid, seq, num_tokens, digest, tuple(first)), secret))]


def abort(rid: str, reason: str, secret: bytes = SECRET) -> list[bytes]:
    return [encode(sign(AbortHeader(rid, reason), secret))]


def feed(inbox: Inbox, frames: list[bytes], peer: bytes = PEER) -> str | None:
    """Deliver one message; the rejection reason, or None if accepted."""
    try:
        deliver(inbox, peer, ListFrames(frames))
    except WireError as exc:
        inbox.reject(exc.reason)
        return exc.reason
    return None


def send_all(inbox: Inbox, seq0: int = 0) -> int:
    """Every page the reservation lacks, one message per layer (runs split where the
    reserved ids are not consecutive: [1, 4) and [4, 5))."""
    seq = seq0
    for layer in range(LAYOUT.num_layers):
        assert feed(inbox, pages("r", seq, layer, [(1, 3), (4, 1)])) is None
        seq += 1
    return seq


def untouched(kv: torch.Tensor, before: torch.Tensor) -> bool:
    return torch.equal(kv.index_select(1, FORBIDDEN), before.index_select(1, FORBIDDEN))


def block_content(kv: torch.Tensor, layer: int, block_id: int) -> bytes:
    return kv[layer, block_id].numpy().tobytes()


# -- the inbox ---------------------------------------------------------------------


def test_complete_transfer_lands_in_reserved_blocks_only():
    inbox = make_inbox()
    before = inbox.kv.clone()
    seq = send_all(inbox)
    assert feed(inbox, final("r", seq)) is None
    [event] = inbox.take_events()
    assert event.ok and event.first_tokens == (7,) and event.peer == PEER
    assert event.nbytes == LAYOUT.num_layers * 4 * PAGE
    kv = inbox.kv
    for layer in range(LAYOUT.num_layers):
        for index in range(SKIP, len(RESERVED)):
            assert block_content(kv, layer, RESERVED[index]) == page_bytes(layer, index)
    assert untouched(kv, before)  # incl. the cached block 9
    assert inbox.pending() == [] and not inbox.rejected


@pytest.mark.parametrize("message, reason", [
    (pages("nope", 0, 0, [(1, 1)]), "unknown_request"),
    (pages("r", 0, 0, [(0, 1)]), "out_of_range"),  # the decoder's cached block
    (pages("r", 0, 0, [(4, 2)]), "out_of_range"),  # past the reservation
    (pages("r", 0, 3, [(1, 1)]), "out_of_range"),  # no such layer
    (pages("r", 0, 0, [(2, 2), (3, 1)]), "out_of_range"),  # overlapping runs
    (pages("r", 0, 0, [(1, 1)], dtype="float16"), "bad_layout"),
    (pages("r", 0, 0, [(1, 1)], page=(4, 2, 16)), "bad_layout"),
    (pages("r", 0, 0, [(1, 2)], nbytes=(PAGE,)), "bad_length"),
    (pages("r", 0, 0, [(1, 2)], frames=[b"\x01" * (2 * PAGE - 4)]), "truncated"),
    (pages("r", 0, 0, [(1, 2)], frames=[b"\x01" * (2 * PAGE + 4)]), "oversized"),
    (pages("r", 0, 0, [(1, 1), (2, 1)], frames=[b"\x01" * PAGE]), "truncated"),
    (pages("r", 0, 0, [(1, 1)], frames=[b"\x01" * PAGE, b"\x01"]), "extra_frames"),
    (pages("r", 0, 0, [(1, 1)], via="p2p"), "bad_header"),
    ([encode(HelloHeader("x")), b"junk"], "extra_frames"),
    ([], "truncated"),
])
def test_rejected_messages_are_counted_and_change_nothing(message, reason):
    inbox = make_inbox()
    outside = inbox.kv.clone()
    assert feed(inbox, message) == reason
    assert inbox.rejected == {reason: 1}
    # A rejected message contributes no pages (a short frame may have scribbled on the
    # reserved blocks, never elsewhere); the transfer is still live and can complete.
    assert untouched(inbox.kv, outside)
    assert inbox.pending() == ["r"]
    seq = send_all(inbox)
    assert feed(inbox, final("r", seq)) is None
    assert inbox.take_events()[0].ok


def test_a_truncated_message_leaves_its_pages_missing():
    inbox = make_inbox()
    seq = send_all(inbox)
    # A later, broken resend of layer 0 un-counts those pages: the final must fail,
    # never commit half-written KV.
    assert feed(inbox, pages("r", seq, 0, [(1, 3)], frames=[b"\x00" * 10])) == "truncated"
    assert feed(inbox, final("r", seq)) is None
    [event] = inbox.take_events()
    assert not event.ok and "3 pages never arrived" in event.reason


@pytest.mark.parametrize("seq, why", [(0, "replayed"), (2, "lost")])
def test_a_replay_or_a_gap_fails_the_transfer(seq, why):
    inbox = make_inbox()
    assert feed(inbox, pages("r", 0, 0, [(1, 3)])) is None
    assert feed(inbox, pages("r", seq, 1, [(1, 3)])) == "bad_sequence"
    [event] = inbox.take_events()
    assert not event.ok and why in event.reason
    assert inbox.pending() == []
    assert feed(inbox, pages("r", 1, 1, [(1, 3)])) == "unknown_request"


@pytest.mark.parametrize("message", [
    pages("r", 0, 0, [(1, 3)], secret=b"x" * 32),  # a wrong secret
    pages("r", 0, 0, [(1, 3)], secret=new_secret()),  # another reservation's
    final("r", 0, secret=b"x" * 32),
    abort("r", "bye", secret=b"x" * 32),
    [encode(PagesHeader("r", 0, 0, ((1, 3),), (3 * PAGE,), LAYOUT.dtype, LAYOUT.wire_page, mac=b"\0" * 32)),
     page_bytes(0, 1, 3)],
])
def test_a_message_without_the_secret_fails_the_reservation_and_lands_nothing(message):
    inbox = make_inbox()
    before = inbox.kv.clone()
    assert feed(inbox, message) == "bad_mac"
    [event] = inbox.take_events()
    assert not event.ok and "secret" in event.reason and event.peer is None
    assert torch.equal(inbox.kv, before)  # not a byte of it landed, reserved blocks included
    assert inbox.pending() == []
    # the real sender, too late: refused, and told once (a failed ack), so it frees its
    # held blocks now rather than at its lease's end
    assert feed(inbox, pages("r", 0, 0, [(1, 3)])) == "ended_request"
    assert inbox.take_events() == []  # no new terminal event: a reply to that sender
    [(peer, told)] = inbox.take_replies()
    assert not told.ok and peer == PEER and "secret" in told.reason
    assert torch.equal(inbox.kv, before)
    assert feed(inbox, final("r", 1)) == "unknown_request" and inbox.take_replies() == []


def test_the_sender_of_a_reservation_cancelled_before_any_page_is_told():
    """Only a message proving the ended reservation's secret hears why (a stranger
    learns nothing), and only the first; a reservation a sender was bound to is told
    when it fails, as before."""
    inbox = make_inbox()
    assert inbox.cancel("r", "deadline exceeded")
    [event] = inbox.take_events()
    assert not event.ok and event.peer is None
    assert feed(inbox, pages("r", 0, 0, [(1, 3)], secret=new_secret()), peer=b"stranger") == "unknown_request"
    assert inbox.take_replies() == []
    assert feed(inbox, pages("r", 0, 0, [(1, 3)])) == "ended_request"
    [(peer, told)] = inbox.take_replies()
    assert (told.ok, peer, told.reason) == (False, PEER, "deadline exceeded")
    assert inbox.take_events() == []


def test_a_bound_transfer_ignores_unproven_messages_from_others():
    inbox = make_inbox()
    assert feed(inbox, pages("r", 0, 0, [(1, 3)])) is None
    assert feed(inbox, pages("r", 1, 1, [(1, 3)], secret=b"x" * 32), peer=b"intruder") == "wrong_peer"
    assert inbox.pending() == ["r"]
    assert feed(inbox, pages("r", 1, 1, [(1, 3)], secret=b"x" * 32)) == "bad_mac"  # the bound sender, gone wrong
    assert not inbox.take_events()[0].ok


def test_a_transfer_starts_with_its_first_proven_message_once():
    """`take_started` (what makes a reservation RECEIVING on the worker) names a
    transfer when a message proving its secret begins to land, once; refused ones
    start nothing."""
    inbox = make_inbox()
    assert feed(inbox, pages("r", 0, 0, [(1, 3)], secret=new_secret())) == "bad_mac"
    assert inbox.take_started() == []
    inbox.expect(Transfer("r2", RESERVED, SKIP, len(PROMPT), DIGEST, SECRET))
    assert feed(inbox, pages("r2", 0, 0, [(1, 3)], frames=[b"x"])) == "truncated"  # proven: it began to land
    assert feed(inbox, pages("r2", 0, 0, [(1, 3)])) is None
    assert feed(inbox, pages("r2", 1, 1, [(1, 3)])) is None
    assert inbox.take_started() == ["r2"] and inbox.take_started() == []


def test_a_transfer_is_bound_to_its_first_accepted_sender():
    inbox = make_inbox()
    # A rejected message binds nothing, so it cannot lock the real sender out.
    assert feed(inbox, pages("r", 0, 0, [(1, 3)], frames=[b"x"]), peer=b"intruder") == "truncated"
    assert feed(inbox, pages("r", 0, 0, [(1, 3)])) is None
    assert feed(inbox, pages("r", 1, 0, [(1, 3)]), peer=b"intruder") == "wrong_peer"
    assert feed(inbox, abort("r", "go away"), peer=b"intruder") == "wrong_peer"
    assert inbox.pending() == ["r"]


@pytest.mark.parametrize("message, why", [
    (final("r", 0, digest=prompt_digest([1, 2, 3])), "prompt does not match"),
    (final("r", 0, num_tokens=17), "prompt does not match"),
    (final("r", 0), "pages never arrived"),
    (abort("r", "prefill failed"), "sender aborted: prefill failed"),
])
def test_final_without_the_right_pages_fails_the_transfer(message, why):
    inbox = make_inbox()
    assert feed(inbox, message) is None
    [event] = inbox.take_events()
    assert not event.ok and why in event.reason
    assert inbox.pending() == []


def test_cancel_ends_reservations_and_the_inbox_keeps_no_deadline():
    """A transfer ends when its owner (the worker's request table) cancels it: at
    its deadline too, which is the owner's; the inbox waits as long as it is told."""
    inbox = make_inbox()
    inbox.expect(Transfer("s", (0, 1), 0, 8, prompt_digest(list(range(8))), SECRET))
    assert inbox.cancel("r", "client went away")
    assert inbox.cancel("r")  # already gone: safe to free
    assert [e.request_id for e in inbox.take_events()] == ["r"]
    assert inbox.pending() == ["s"]
    assert inbox.cancel("s", "deadline exceeded")  # the owner's deadline passed
    [event] = inbox.take_events()
    assert event.request_id == "s" and not event.ok and "deadline" in event.reason
    assert feed(inbox, pages("s", 0, 0, [(0, 1)])) == "ended_request"  # its sender hears why, once
    assert [(peer, ack.request_id) for peer, ack in inbox.take_replies()] == [(PEER, "s")]
    assert feed(inbox, pages("s", 1, 0, [(0, 1)])) == "unknown_request"


def test_a_cancel_during_a_write_waits_for_it_and_never_blocks():
    inbox = make_inbox()
    header = sign(PagesHeader("r", 0, 0, ((1, 3),), (3 * PAGE,), LAYOUT.dtype, LAYOUT.wire_page), SECRET)
    with inbox.pages(header, PEER) as landings:
        # Bytes are landing (p2p receives can take a while): the engine thread is not
        # blocked, but it must not free the blocks yet.
        other = threading.Thread(target=inbox.expect, args=(Transfer("x", (0,), 0, 2, DIGEST, SECRET),))
        other.start()
        other.join(5)
        assert not other.is_alive()
        assert inbox.cancel("r", "client went away") is False
        assert inbox.take_events() == []
        landings[0].buffer()[:] = page_bytes(0, 1, 3)
    [event] = inbox.take_events()
    assert not event.ok and event.reason == "client went away"
    assert inbox.cancel("r") is True  # gone: nothing writes its blocks any more
    assert inbox.pending() == ["x"]


def test_expect_refuses_bad_reservations():
    inbox = make_inbox()
    with pytest.raises(ValueError, match="already expected"):
        inbox.expect(Transfer("r", RESERVED, SKIP, len(PROMPT), DIGEST, SECRET))
    with pytest.raises(ValueError, match="block_ids"):
        inbox.expect(Transfer("x", (1, NUM_BLOCKS), 0, 8, DIGEST, SECRET))
    with pytest.raises(ValueError, match="num_tokens"):
        inbox.expect(Transfer("x", (1, 2), 0, 9, DIGEST, SECRET))
    for secret in (b"", b"short", "s" * 32, None):
        with pytest.raises(ValueError, match="secret"):
            inbox.expect(Transfer("x", (1, 2), 0, 8, DIGEST, secret))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_pages_keep_their_bits(dtype):
    layout = PageLayout(2, 4, 1, 8, dtype)
    kv = torch.zeros((2, 6, *layout.page_shape), dtype=layout.torch_dtype)
    inbox = Inbox(kv)
    inbox.expect(Transfer("h", (4, 2), 0, 5, prompt_digest([1] * 5), SECRET))
    src = torch.randn((2, 2, *layout.page_shape)).to(layout.torch_dtype)
    for layer in range(2):
        raw = [src[layer, i].view(torch.uint8).numpy().tobytes() for i in range(2)]
        header = PagesHeader("h", layer, layer, ((0, 1), (1, 1)), (layout.page_bytes,) * 2, dtype, layout.wire_page)
        deliver(inbox, PEER, ListFrames([encode(sign(header, SECRET)), *raw]))
    deliver(inbox, PEER, ListFrames([encode(sign(FinalHeader("h", 2, 5, prompt_digest([1] * 5), ()), SECRET))]))
    assert inbox.take_events()[0].ok
    assert torch.equal(kv[:, [4, 2]].view(torch.int16), src.view(torch.int16))


# FP8 pages (--kv-cache-dtype fp8*) travel as stored: a quarter of float32's bytes.
FP8 = ("float8_e4m3fn", "float8_e5m2")


def random_pages(layout: PageLayout, layers: int, blocks: int, seed: int) -> torch.Tensor:
    """Pages of every byte value (NaN and infinity patterns included) as `layout`'s dtype."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layers, blocks, *layout.page_shape), dtype=torch.uint8, generator=g)
    return raw.view(layout.torch_dtype)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_pages_land_byte_exactly(dtype):
    """Straight landings (consecutive reserved blocks) and staged ones (scattered by
    `commit` through byte views: torch has no index_copy_ for float8) keep every byte."""
    layout = PageLayout(2, 4, 1, 8, dtype)
    kv = torch.zeros((2, 8, *layout.page_shape), dtype=layout.torch_dtype)
    inbox = Inbox(kv)
    reserved, prompt = (4, 2, 3), [1] * 10  # 3 blocks of 4
    inbox.expect(Transfer("f", reserved, 0, len(prompt), prompt_digest(prompt), SECRET))
    src = random_pages(layout, 2, 3, seed=5)
    runs = ((0, 2), (2, 1))  # blocks 4, 2: staged; block 3: straight into the cache
    for layer in range(2):
        frames = [src[layer, f : f + c].contiguous().view(torch.uint8).numpy().tobytes() for f, c in runs]
        header = PagesHeader("f", layer, layer, runs, tuple(c * layout.page_bytes for _, c in runs), dtype,
                             layout.wire_page)
        raw = encode(sign(header, SECRET))
        assert decode(raw) == sign(header, SECRET)  # the header names the dtype
        deliver(inbox, PEER, ListFrames([raw, *frames]))
    deliver(inbox, PEER, ListFrames([encode(sign(FinalHeader("f", 2, len(prompt), prompt_digest(prompt), ()), SECRET))]))
    (event,) = inbox.take_events()
    assert event.ok and event.nbytes == 2 * 3 * layout.page_bytes
    assert torch.equal(kv[:, list(reserved)].view(torch.uint8), src.view(torch.uint8))
    untouched = [b for b in range(8) if b not in reserved]
    assert not kv[:, untouched].view(torch.uint8).any()


@pytest.mark.parametrize("sent", ["float8_e5m2", "float32", "bfloat16"])
def test_pages_of_another_dtype_are_dropped_on_arrival(sent):
    """The same byte count is not enough: e5m2 pages never land in an e4m3 cache."""
    layout = PageLayout(1, 4, 1, 8, "float8_e4m3fn")
    kv = torch.zeros((1, 4, *layout.page_shape), dtype=layout.torch_dtype)
    inbox = Inbox(kv)
    inbox.expect(Transfer("x", (1,), 0, 4, prompt_digest([1] * 4), SECRET))
    header = PagesHeader("x", 0, 0, ((0, 1),), (layout.page_bytes,), sent, layout.wire_page)
    with pytest.raises(WireError, match="bad_layout") as err:
        deliver(inbox, PEER, ListFrames([encode(sign(header, SECRET)), b"\x7f" * layout.page_bytes]))
    assert "float8_e4m3fn" in str(err.value) and sent in str(err.value)
    assert not kv.view(torch.uint8).any() and inbox.pending() == ["x"]


# -- property: nothing a peer sends escapes its reservation ----------------------------

_ints = st.one_of(st.integers(-2, 6), st.integers(-(2**63), 2**64 - 1), st.booleans(), st.floats(allow_nan=False), st.none())
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=5), st.binary(max_size=5))
_objects = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=4), max_leaves=8)
_good_runs = st.lists(st.integers(1, 4).flatmap(lambda f: st.tuples(st.just(f), st.integers(1, 5 - f))), min_size=1, max_size=2)
AUTO = "<next seq>"  # replaced by the transfer's next sequence number when the test sends it
SIGNED = "<mac>"  # replaced by the message's mac under SECRET, when its other fields parse
_bad_runs = st.lists(st.lists(st.integers(-1, 6), max_size=3), max_size=4)
_junk_frames = st.lists(st.sampled_from([0, 1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 4 * PAGE]).map(lambda n: b"\x07" * n), max_size=4)


def _sometimes(draw, good, bad, p_bad: float = 0.05):
    """`good`, or a draw from `bad` with probability about p_bad."""
    return draw(bad) if draw(st.integers(0, 99)) < p_bad * 100 else good


@st.composite
def _message(draw) -> tuple[dict | bytes, list[bytes]]:
    """Mostly plausible messages (so many get far into the inbox), some fields broken,
    some pure garbage."""
    shape = draw(st.sampled_from(["pages"] * 10 + ["final", "final", "abort", "other", "bytes", "object"]))
    if shape == "bytes":
        return draw(st.binary(max_size=64)), draw(_junk_frames)
    if shape == "object":
        return msgpack.packb(draw(_objects), use_bin_type=True), draw(_junk_frames)
    d = {
        "v": _sometimes(draw, VERSION, st.sampled_from([0, 1, 3, "2", True, None])),
        "kind": shape if shape != "other" else draw(st.sampled_from(["ack", "hello", "welcome", "x", 3])),
        "rid": _sometimes(draw, "r", st.sampled_from(["other", "", 5])),
        "seq": _sometimes(draw, AUTO, st.one_of(st.integers(0, 4), _ints), 0.2),
    }
    frames: list[bytes] = []
    if shape == "pages":
        runs = [list(r) for r in draw(_good_runs)]
        byte = draw(st.integers(1, 255))
        frames = [bytes([byte]) * (c * PAGE) for _, c in runs]
        d.update(
            layer=_sometimes(draw, draw(st.integers(0, 2)), _ints),
            runs=_sometimes(draw, runs, _bad_runs),
            nbytes=_sometimes(draw, [c * PAGE for _, c in runs], st.lists(st.integers(-1, 4 * PAGE + 1), max_size=4)),
            dtype=_sometimes(draw, "float32", st.sampled_from(["float16", "int8", 1])),
            page=_sometimes(draw, [4, 2, 8], st.sampled_from([[4, 2], [8, 2, 4], "x"])),
            via=_sometimes(draw, "frames", st.sampled_from(["p2p", None])),
        )
        frames = _sometimes(draw, frames, _junk_frames, 0.2)
    elif shape == "final":
        d.update(num_tokens=_sometimes(draw, len(PROMPT), st.sampled_from([17, 0])),
                 digest=_sometimes(draw, DIGEST, st.sampled_from([b"x" * 32, b"x"])),
                 first=_sometimes(draw, [draw(st.integers(0, 300))], st.lists(st.integers(-1, 300), max_size=3)))
    elif shape == "abort":
        d["reason"] = draw(st.text(max_size=8))
    if shape in ("pages", "final", "abort"):
        d["mac"] = _sometimes(draw, SIGNED, st.sampled_from([b"x" * 32, b"x", new_secret()]), 0.1)
    if draw(st.integers(0, 9)) == 0:  # drop a field
        d.pop(draw(st.sampled_from(sorted(d))))
    return d, frames


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_message(), st.sampled_from([PEER] * 5 + [b"other"])), min_size=1, max_size=16))
def test_random_messages_never_escape_the_reservation(messages):
    inbox = make_inbox()
    before = inbox.kv.clone()
    seq = 0  # AUTO headers get the next number the inbox would accept
    for (header, frames), peer in messages:
        auto = isinstance(header, dict) and header.get("seq") == AUTO
        if isinstance(header, dict):
            header = _signed(msgpack.packb({**header, "seq": seq} if auto else header, use_bin_type=True))
        try:
            deliver(inbox, peer, ListFrames([header, *frames]))
            seq += auto
        except WireError as exc:
            inbox.reject(exc.reason)
        assert untouched(inbox.kv, before)
    events = inbox.take_events()
    assert [e.request_id for e in events] in ([], ["r"])  # at most one terminal event
    assert len(inbox.pending()) + len(events) == 1


def _signed(raw: bytes) -> bytes:
    """A header whose mac is SIGNED, signed with the reservation's secret if it parses."""
    d = msgpack.unpackb(raw, raw=False)
    if d.get("mac") != SIGNED:
        return raw
    try:
        header = decode(msgpack.packb({**d, "mac": b"\0" * 32}, use_bin_type=True))
    except WireError:
        return raw
    return encode(sign(header, SECRET))


# -- an EAGLE head's state with the final message ---------------------------------------

DRAFT = DraftLayout(torch.float32, num_kv_heads=2, head_dim=4, feature_size=6)  # rows of 64 bytes, a 24-byte feature


def draft_inbox(layout: DraftLayout | None = DRAFT) -> Inbox:
    inbox = Inbox(make_kv())
    inbox.expect(Transfer("r", RESERVED, SKIP, len(PROMPT), DIGEST, SECRET, layout))
    return inbox


def draft_bytes(base: int) -> bytes:
    rows = len(PROMPT) - 1 - base
    return (torch.arange(rows * 16 + 6, dtype=torch.float32) + 0.5).numpy().tobytes()


def final_with_draft(seq: int, base: int, data: bytes, frame: int = 40, dtype: str = "float32",
                     nbytes: int | None = None) -> list[bytes]:
    header = FinalHeader("r", seq, len(PROMPT), DIGEST, (7,), (base, len(data) if nbytes is None else nbytes, dtype))
    return [encode(sign(header, SECRET)), *[data[i : i + frame] for i in range(0, len(data), frame)]]


@pytest.mark.parametrize("base", [0, 5, len(PROMPT) - 1])
def test_a_final_message_carries_the_head_state_in_frames(base):
    """Rows base .. num_tokens-2 of the head's KV, then the feature at num_tokens-1, cut
    into frames of any size: the event holds them as tensors of the head's layout."""
    inbox = draft_inbox()
    seq = send_all(inbox)
    data = draft_bytes(base)
    assert feed(inbox, final_with_draft(seq, base, data)) is None
    [event] = inbox.take_events()
    assert event.ok, event.reason
    rows = len(PROMPT) - 1 - base
    draft = event.draft
    assert draft.base == base and draft.kv.shape == (rows, 2, 2, 4) and draft.feature.shape == (6,)
    assert draft.kv.dtype == draft.feature.dtype == torch.float32
    assert draft.kv.numpy().tobytes() + draft.feature.numpy().tobytes() == data


@pytest.mark.parametrize("change, why", [
    (dict(dtype="float16"), "head state of float16"),
    (dict(nbytes=16 * 4 * 12 + 24 + 4), "head state of"),  # a row's worth off
    (dict(base=len(PROMPT)), "from position"),
    (dict(data_cut=4), "truncated"),
    (dict(data_extra=4), "exceed"),
])
def test_a_head_state_that_does_not_fit_fails_the_transfer(change, why):
    """Checked by dtype and size against the reservation's layout before a byte is read,
    and the frames must hold exactly the bytes declared."""
    inbox = draft_inbox()
    seq = send_all(inbox)
    base = change.get("base", 5)
    data = draft_bytes(min(base, len(PROMPT) - 1))
    nbytes = change.get("nbytes", len(data))
    if "data_cut" in change:
        data = data[: -change["data_cut"]]
    if "data_extra" in change:
        data += b"\0" * change["data_extra"]
    message = final_with_draft(seq, base, data, dtype=change.get("dtype", "float32"), nbytes=nbytes)
    assert feed(inbox, message) in ("bad_draft", "truncated", "oversized")
    [event] = inbox.take_events()
    assert not event.ok and why in event.reason, event.reason
    assert inbox.pending() == []


def test_a_head_state_for_a_worker_without_a_head_fails_the_transfer():
    inbox = draft_inbox(None)
    seq = send_all(inbox)
    assert feed(inbox, final_with_draft(seq, 5, draft_bytes(5))) == "bad_draft"
    [event] = inbox.take_events()
    assert not event.ok and "without an EAGLE head" in event.reason


def test_a_final_without_a_head_state_is_taken_by_a_worker_with_a_head():
    """The prefill worker had none to give (its head never saw the prompt's last
    position): the decode worker's head starts at the first decoded token."""
    inbox = draft_inbox()
    seq = send_all(inbox)
    assert feed(inbox, final("r", seq)) is None
    [event] = inbox.take_events()
    assert event.ok and event.draft is None


def test_the_mac_covers_the_head_state_header():
    """A head state's description cannot be swapped under a proven final message."""
    inbox = draft_inbox()
    seq = send_all(inbox)
    data = draft_bytes(5)
    good = final_with_draft(seq, 5, data)
    forged = decode(good[0])
    forged_raw = encode(FinalHeader("r", seq, len(PROMPT), DIGEST, (7,), (4, len(data) + 64, "float32"), forged.mac))
    assert feed(inbox, [forged_raw, data + b"\0" * 64]) == "bad_mac"

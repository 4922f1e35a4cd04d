"""The receiver's acceptance state machine: which reservation a message may fill,
when it is accepted, refused, or fails its transfer (the frames themselves are
kvtransfer/wire.py's).

Blocks are named by their index in the prompt's block table, never by a worker's
physical block id: the receiver maps an index to the block it reserved itself, so
no header can point a write at another request's block, and indices below the
receiver's cached prefix (`skip`) are refused.

Only the sender the router chose may fill a reservation: every pages, final and
abort message must prove the reservation's one-time secret (wire.py `sign`). A
message that does not fails the reservation (its blocks are freed; nothing it
carried is kept), unless the reservation is already bound to another sender, whose
transfer it then leaves alone.

`seq` numbers a request's pages and final messages 0, 1, 2, ... in sending order.
The receiver accepts exactly the next number: a smaller one is a replay and a larger
one means a message was lost; either fails the transfer. A final message is accepted
only when every page of every layer from `skip` on has arrived intact, and only then
may the pages enter the decode worker's prefix cache (on commit). The head state a
final message carries is taken only if the reservation expects one (its own head's
DraftLayout) and its size and dtype are exactly that layout's for those rows.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.spec.draft_state import DraftState
from pdserve.kvtransfer.transfer import Phase, Transfer
from pdserve.kvtransfer.wire import (
    AbortHeader,
    AckHeader,
    FinalHeader,
    Header,
    PageLayout,
    PagesHeader,
    Signed,
    WireError,
    as_bytes_view,
    check_secret,
    decode,
    proves,
)

MAX_ENDED = 4096  # ended reservations an Inbox remembers, to tell their late senders


# -- the receiver's table -------------------------------------------------------------


@dataclass(frozen=True)
class TransferEvent:
    """A transfer reached a terminal state on the receiver (done, or failed with a reason)."""

    request_id: str
    ok: bool
    reason: str = ""
    first_tokens: tuple[int, ...] = ()
    peer: bytes | None = None
    nbytes: int = 0
    draft: DraftState | None = None  # the prefill worker's EAGLE head state, when one came


class Landing:
    """Where one run's bytes land: straight in the reserved pages when their block ids are
    consecutive (and, for `host` byte transports, on the CPU); otherwise in a staging
    buffer that `commit` scatters into those pages."""

    def __init__(self, kv: torch.Tensor, layer: int, block_ids: Sequence[int], host: bool,
                 layer_bytes: memoryview | None = None) -> None:
        self._kv, self._layer, self._ids = kv, layer, block_ids
        first, n = block_ids[0], len(block_ids)
        consecutive = block_ids[-1] - first == n - 1 and all(b == first + i for i, b in enumerate(block_ids))
        self._staged = not consecutive or (host and kv.device.type != "cpu")
        self._view: memoryview | None = None
        self._tensor: torch.Tensor | None = None
        if self._staged:
            device = torch.device("cpu") if host else kv.device
            pin = host and kv.device.type == "cuda"
            self._tensor = torch.empty((n, *kv.shape[2:]), dtype=kv.dtype, device=device, pin_memory=pin)
            self.nbytes = self._tensor.numel() * self._tensor.element_size()
        elif host and layer_bytes is not None:
            page = layer_bytes.nbytes // kv.shape[1]
            self._view = layer_bytes[first * page : (first + n) * page]  # no torch call: cheap
            self.nbytes = self._view.nbytes
        else:
            self.nbytes = self.tensor.numel() * self.tensor.element_size()

    @property
    def tensor(self) -> torch.Tensor:
        """The landing area as pages [n, 2, block_size, heads, head_dim] (for p2p receives)."""
        if self._tensor is None:
            self._tensor = self._kv[self._layer, self._ids[0] : self._ids[0] + len(self._ids)]
        return self._tensor

    def buffer(self) -> memoryview:
        """Writable bytes of the landing area (CPU only)."""
        return self._view if self._view is not None else as_bytes_view(self.tensor)

    def commit(self) -> None:
        if self._staged:  # as bytes: torch has no index_copy_ for float8 pages
            index = torch.tensor(list(self._ids), device=self._kv.device)
            pages = self.tensor.to(self._kv.device).view(torch.uint8)
            self._kv[self._layer].view(torch.uint8).index_copy_(0, index, pages)


class Inbox:
    """The receiver's transfers: which blocks each may fill, what has landed, and the
    acknowledgements owed. Bytes and acknowledgements only: whether and when a request
    waits, expires or is freed is its owner's (services/worker/requests.py), which
    ends a transfer here with `cancel`. Each transfer is the connector's own
    `Transfer` (transfer.py, where its phases are drawn), indexed here by request id:

        expect ──first proven message──> LANDING ──final, all pages──> ARRIVED: done event
           │ bad message / sender abort / lost connection ──> FAILED: failed event
           │ cancel ──> CANCELLED: failed event (acks the sender; its owner already knows)
           └ cancel (or a lost sender) while a write lands: CANCELLING, CANCELLED when
             the write ends

    Thread-safe: the engine thread calls `expect`/`cancel`, a transport thread feeds
    messages. Every write into the KV tensor happens inside `pages()` under the lock and
    only into blocks of a live reservation at indices >= its `skip`; once a transfer is
    done or failed it leaves the table before its event is published, so nothing writes
    its blocks after the engine learns of it (and maybe frees them).
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.layout = PageLayout.of(kv_cache)
        self.kv = kv_cache
        self.lock = threading.RLock()
        self.rejected: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self._table: dict[str, Transfer] = {}
        self._events: list[TransferEvent] = []
        self._started: list[str] = []  # transfers whose first proven message began to land
        # Reservations that ended before any sender was bound to them (no message
        # accepted): their secret and why, so the first message their sender sends
        # later (proving the secret) is answered with a failed ack, and the sender
        # frees its held blocks at once instead of at its lease's end. Bounded.
        self._ended: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._replies: list[tuple[bytes, AckHeader]] = []  # (peer, failed ack) to send: see `take_replies`
        # Flat bytes of each layer, so a landing is a memoryview slice (no torch call).
        self._layer_bytes = [as_bytes_view(kv_cache[i]) for i in range(kv_cache.shape[0])] if kv_cache.device.type == "cpu" else None

    # -- engine side -------------------------------------------------------------

    def expect(self, t: Transfer) -> None:
        """Register a reservation's transfer: pages of blocks [skip, len(block_ids)) will
        arrive, in messages that prove its secret (which only the chosen sender knows),
        and maybe the head state of its `draft` layout with the final message."""
        check_secret(t.secret)
        n = len(t.block_ids)
        num_blocks = self.kv.shape[1]
        if not 0 <= t.skip <= n or any(not 0 <= b < num_blocks for b in t.block_ids):
            raise ValueError(f"block_ids: out of range for {t.request_id!r}")
        if -(-t.num_tokens // self.layout.block_size) != n:
            raise ValueError(f"num_tokens: {t.num_tokens} tokens do not fill {n} blocks")
        if t.phase is not Phase.EXPECTED:
            raise ValueError(f"request_id: {t.request_id!r} has been expected before")
        with self.lock:
            if t.request_id in self._table:
                raise ValueError(f"request_id: {t.request_id!r} is already expected")
            t.block_ids = tuple(t.block_ids)
            t.have = [bytearray(n) for _ in range(self.layout.num_layers)]
            t.missing = (n - t.skip) * self.layout.num_layers
            self._table[t.request_id] = t

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Fail a reservation (its owner gave up on it: aborted, or its deadline passed).
        True when nothing writes its blocks any more, so the engine may free them now;
        False while a message is landing in them: the failed event follows when that
        write ends (bounded by the transport's timeout), and the blocks must be freed
        only then. Never waits for the network."""
        with self.lock:
            t = self._table.get(request_id)
            if t is None:
                return True
            if t.phase is Phase.LANDING:
                t.phase, t.reason = Phase.CANCELLING, reason
                return False
            if t.phase is Phase.CANCELLING:
                return False
            self._end(t, Phase.CANCELLED, reason)
            return True

    def has_events(self) -> bool:
        """Events or replies to hand out (a racy peek is fine: the takes are locked)."""
        return bool(self._events or self._replies)

    def take_replies(self) -> list[tuple[bytes, AckHeader]]:
        """Failed acks for senders of reservations that had already ended (not events:
        nothing changed state); the transport sends each to its peer."""
        with self.lock:
            replies, self._replies = self._replies, []
            return replies

    def take_events(self) -> list[TransferEvent]:
        with self.lock:
            events, self._events = self._events, []
            return events

    def take_started(self) -> list[str]:
        """Transfers whose first message proving their secret began to land since the
        last call (each once; not events: nothing ended)."""
        with self.lock:
            started, self._started = self._started, []
            return started

    def pending(self) -> list[str]:
        with self.lock:
            return list(self._table)

    def fail_peer(self, peer: bytes, reason: str, request_id: str | None = None) -> None:
        """The connection to a sender broke: fail its transfers now (and `request_id`'s,
        if no other sender holds it) instead of leaving them to their owners' deadlines."""
        with self.lock:
            for t in list(self._table.values()):
                if t.peer == peer or (t.request_id == request_id and t.peer is None):
                    if t.phase is Phase.LANDING:  # ends with the write (the owner hears of it then)
                        t.phase, t.reason = Phase.CANCELLING, reason
                    elif t.phase is not Phase.CANCELLING:
                        self._fail(t, reason)

    # -- transport side ----------------------------------------------------------

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] += 1

    @contextlib.contextmanager
    def pages(self, h: PagesHeader, peer: bytes, host: bool = True) -> Iterator[list[Landing]]:
        """Validate a pages header and yield where each run must land.

        The caller fills every landing (raising WireError if the bytes do not match);
        on a clean exit the pages count as received, on any exception none of this
        message's pages do, and the exception propagates (the caller counts it). The
        lock is not held while the bytes land: the transfer is marked `writing`, so a
        cancel meanwhile is deferred until the write ends (LANDING -> CANCELLING; one
        transport thread writes, so at most one message per transfer is in flight).
        """
        with self.lock:
            t = self._admit(h, peer)
            if t.phase is Phase.CANCELLING:  # its owner gave up; the write in flight ends it
                raise WireError("ended_request", f"the reservation for {h.request_id!r} is being cancelled")
            layer_bytes = self._layer_bytes[h.layer] if self._layer_bytes is not None else None
            landings = [Landing(self.kv, h.layer, t.block_ids[f : f + c], host, layer_bytes) for f, c in h.runs]
            if not t.started:
                self._started.append(t.request_id)
            t.phase = Phase.LANDING
        ok = False
        try:
            yield landings
            for landing in landings:
                landing.commit()
            ok = True
        finally:
            with self.lock:
                self._mark(t, h, 1 if ok else 0)
                if ok:
                    t.peer = peer  # the first accepted message binds the transfer to its sender
                    t.next_seq += 1
                    t.nbytes += h.total_bytes
                    self.stats["bytes"] += h.total_bytes
                    self.stats["messages"] += 1
                if t.phase is Phase.CANCELLING:
                    self._end(t, Phase.CANCELLED, t.reason)
                elif not t.phase.ended:
                    t.phase = Phase.RECEIVING

    def final(self, h: FinalHeader, peer: bytes, src: FrameSource | None = None) -> None:
        """The last message: complete the transfer (or fail it if pages are missing, or
        the head state in its frames (`src`) is not what the reservation takes)."""
        with self.lock:
            t = self._check_seq(self._proven(h, peer), h.seq, peer)
            if t is None:
                return
            t.peer = peer
            if h.num_tokens != t.num_tokens or h.digest != t.digest:
                self._fail(t, "final: prompt does not match the reservation")
                return
            if t.missing:
                self._fail(t, f"final: {t.missing} pages never arrived intact")
                return
            draft = None
            if h.draft is not None:
                try:
                    draft = _read_draft(t, h.draft, src)
                except WireError as exc:
                    self._fail(t, f"final: {exc}")
                    raise
            del self._table[t.request_id]
            t.phase = Phase.ARRIVED
            self.stats["done"] += 1
            self._events.append(TransferEvent(t.request_id, True, "", h.first_tokens, t.peer, t.nbytes, draft))

    def abort(self, h: AbortHeader, peer: bytes) -> None:
        """The sender gave up: fail the transfer now instead of leaving it to its owner's deadline."""
        with self.lock:
            t = self._proven(h, peer)
            t.peer = peer
            self._fail(t, f"sender aborted: {h.reason}")

    # -- internals ---------------------------------------------------------------

    def _proven(self, h: Signed, peer: bytes) -> Transfer:
        """The transfer a message belongs to, once the message proves its secret.

        A message from a sender other than the one a transfer is bound to is refused
        and leaves the transfer alone. Otherwise a message that does not prove the
        secret (a stranger, a wrong or stale secret) fails the transfer: its blocks
        are freed and nothing received for it is ever committed or cached."""
        t = self._table.get(h.request_id)
        if t is None:
            ended = self._ended.get(h.request_id)
            if ended is not None and proves(h, ended[0]):  # its sender, late: tell it (once)
                del self._ended[h.request_id]
                self._replies.append((peer, AckHeader(h.request_id, False, ended[1])))
                raise WireError("ended_request", f"the reservation for {h.request_id!r} has ended: {ended[1]}")
            raise WireError("unknown_request", f"no reservation for {h.request_id!r}")
        if t.peer is not None and t.peer != peer:
            raise WireError("wrong_peer", f"{h.request_id!r} is bound to another sender")
        if not proves(h, t.secret):
            self._fail(t, f"{h.kind} message without the reservation's secret")
            raise WireError("bad_mac", f"{h.kind} for {h.request_id!r} does not prove the reservation's secret")
        return t

    def _check_seq(self, t: Transfer, seq: int, peer: bytes) -> Transfer | None:
        """`t` if `seq` is the next number; None if a replay or a gap just failed it."""
        if seq == t.next_seq:
            return t
        t.peer = peer  # so the sender hears why
        what = "replayed" if seq < t.next_seq else "lost"
        self._fail(t, f"messages {what}: seq {seq}, expected {t.next_seq}")
        return None

    def _admit(self, h: PagesHeader, peer: bytes) -> Transfer:
        lay = self.layout
        t = self._proven(h, peer)
        if h.dtype != lay.dtype or h.page != lay.wire_page:
            raise WireError("bad_layout", f"pages {h.dtype} {h.page}, receiver holds {lay.dtype} {lay.wire_page}")
        if h.layer >= lay.num_layers:
            raise WireError("out_of_range", f"layer {h.layer} >= {lay.num_layers}")
        end = -1
        for (first, count), nbytes in zip(h.runs, h.nbytes):
            if first < t.skip or first + count > len(t.block_ids) or first < end:
                raise WireError("out_of_range", f"run [{first}, {first + count}) outside [{t.skip}, {len(t.block_ids)}) or overlapping")
            if nbytes != count * lay.page_bytes:
                raise WireError("bad_length", f"run of {count} pages declares {nbytes} bytes, expected {count * lay.page_bytes}")
            end = first + count
        if self._check_seq(t, h.seq, peer) is None:
            raise WireError("bad_sequence", f"seq {h.seq} out of order failed {h.request_id!r}")
        return t

    def _mark(self, t: Transfer, h: PagesHeader, value: int) -> None:
        row = t.have[h.layer]
        for first, count in h.runs:
            had = row.count(1, first, first + count)
            row[first : first + count] = bytes([value]) * count
            t.missing += had - (count if value else 0)

    def _fail(self, t: Transfer, reason: str) -> None:
        self._end(t, Phase.FAILED, reason)

    def _end(self, t: Transfer, phase: Phase, reason: str) -> None:
        """The one way a transfer leaves the table without arriving (FAILED or
        CANCELLED); its event follows, after which nothing writes its blocks."""
        del self._table[t.request_id]
        t.phase, t.reason = phase, reason
        if t.peer is None:  # no sender hears of it now: tell it when it shows up
            self._ended[t.request_id] = (t.secret, reason)
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
        self.stats["failed"] += 1
        self._events.append(TransferEvent(t.request_id, False, reason, (), t.peer, t.nbytes))


def _read_draft(t: Transfer, draft: tuple[int, int, str], src: FrameSource | None) -> DraftState:
    """The head state that follows a final header, checked against the reservation's
    layout by dtype and size before a byte is read; WireError if it does not fit."""
    base, nbytes, dtype = draft
    layout = t.draft
    if layout is None:
        raise WireError("bad_draft", "head state sent to a worker without an EAGLE head")
    ours = str(layout.dtype).removeprefix("torch.")
    if dtype != ours:
        raise WireError("bad_draft", f"head state of {dtype}, this worker's head holds {ours}")
    if base > t.num_tokens - 1:
        raise WireError("bad_draft", f"head state from position {base} of a {t.num_tokens}-token prompt")
    rows = t.num_tokens - 1 - base
    want = rows * layout.row_bytes + layout.feature_bytes
    if nbytes != want:
        raise WireError("bad_draft", f"head state of {nbytes} bytes, {rows} rows and a feature of this worker's "
                                     f"head are {want}")
    buf = bytearray(want)
    view, got = memoryview(buf), 0
    while src is not None and src.more():
        n = src.recv_into(view[got:])
        if n > want - got:
            raise WireError("oversized", f"head state frames exceed the {want} bytes declared")
        got += n
    if got != want:
        raise WireError("truncated", f"head state of {got} bytes, {want} declared")
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    kv_bytes = rows * layout.row_bytes
    kv = flat[:kv_bytes].view(layout.dtype).view(rows, 2, layout.num_kv_heads, layout.head_dim)
    return DraftState(base, kv, flat[kv_bytes:].view(layout.dtype))


# -- reading one message -----------------------------------------------------------


class FrameSource(Protocol):
    """The frames of one incoming message after the sender's identity (ZeroMQ's RCVMORE
    semantics: `recv_into` writes at most len(buf) bytes and returns the frame's size)."""

    def more(self) -> bool: ...
    def next_frame(self) -> bytes: ...
    def recv_into(self, buf: memoryview) -> int: ...


def fill_frames(src: FrameSource, landings: list[Landing]) -> None:
    """Copy each run's frame into its landing; WireError unless there is exactly one
    frame per run, each of exactly the run's size."""
    for landing in landings:
        if not src.more():
            raise WireError("truncated", f"{len(landings)} runs announced, fewer frames sent")
        n = src.recv_into(landing.buffer())
        if n != landing.nbytes:
            reason = "oversized" if n > landing.nbytes else "truncated"
            raise WireError(reason, f"frame of {n} bytes for a run of {landing.nbytes}")
    if src.more():
        raise WireError("extra_frames", "more frames than runs")


PagesHandler = Callable[[PagesHeader], None]


def deliver(inbox: Inbox, peer: bytes, src: FrameSource, pages: PagesHandler | None = None) -> Header | None:
    """Read one message: pages, final and abort go to the inbox; any other kind is
    returned for the transport to handle. `pages` replaces the default (frames) way of
    taking page data. Raises WireError on anything malformed; the caller counts it and
    discards what is left of the message."""
    if not src.more():
        raise WireError("truncated", "message has no header frame")
    header = decode(src.next_frame())
    if isinstance(header, PagesHeader):
        if pages is not None:
            pages(header)
            return None
        if header.via != "frames":
            raise WireError("bad_header", f"via {header.via!r}: this receiver takes pages as frames only")
        with inbox.pages(header, peer, host=True) as landings:
            fill_frames(src, landings)
        return None
    if isinstance(header, FinalHeader) and header.draft is not None:
        inbox.final(header, peer, src)
        return None
    if src.more():
        raise WireError("extra_frames", f"{header.kind} message carries data frames")
    if isinstance(header, FinalHeader):
        inbox.final(header, peer)
    elif isinstance(header, AbortHeader):
        inbox.abort(header, peer)
    else:
        return header
    return None

"""The control channel of every KV transport: ZeroMQ for headers, acks and pairing,
with page bytes left to a page mover.

    prefill worker                                        decode worker
    SenderChannel  DEALER --[header (| frames)]-------->  ROUTER  ReceiverChannel
                   DEALER <--------[ack | welcome]------  ROUTER  (one thread, an Inbox)
         |                                                          |
    PageSender  ~~~~~~~~~~~~~~~~~~~ page bytes ~~~~~~~~~~~~~~~~~~>  PageReceiver
      frames: in the header's own message (kvtransfer/transports/zmq.py)
      p2p:    torch.distributed point-to-point after the header (kvtransfer/transports/nccl.py)

A transport is a channel plus a mover: `ZmqReceiver` is a `ReceiverChannel` with
frame pages, `TorchDistReceiver` one with point-to-point pages (and frames), and
likewise on the sending side. The channel owns the sockets, CURVE, the receiver's
thread, its Inbox (every reservation and the rules for accepting a message), acks
and events; a mover only moves the bytes one pages header announces, and may
answer control messages of its own (the p2p mover's hello -> welcome pairing).

The sender is used only from the engine thread. The receiver's socket belongs to its
thread; the engine thread talks to it through the thread-safe `Inbox` and `events()`.

With `CurveConfig`, the receiver is a CURVE server that only admits the listed client
public keys (a ZAP handler checks each handshake): an unauthenticated or unknown sender
never gets a frame through, and every byte on the wire is encrypted and authenticated.
Whatever the keys, every message of a transfer proves the reservation's one-time
secret (wire.py), and sockets refuse frames longer than a page run can be
(ZMQ_MAXMSGSIZE: the peer is disconnected), so no peer makes a receiver buffer more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from pdserve.engine.spec.draft_state import DraftState
from pdserve.kvtransfer.inbox import FrameSource, Inbox, TransferEvent, deliver
from pdserve.kvtransfer.transfer import Export, Transfer
from pdserve.kvtransfer.transports.curve import CurveConfig
from pdserve.kvtransfer.wire import (
    MAX_HEADER_BYTES,
    AckHeader,
    Header,
    PageLayout,
    PagesHeader,
    TransferError,
    WireError,
    abort_message,
    check_secret,
    decode,
    encode,
    final_message,
    sign,
)

ZAP_DOMAIN = "pdserve-kv"
# What ZeroMQ's MAXMSGSIZE sees of a frame beyond its payload: CURVE wraps each frame
# in a MESSAGE command (name, nonce, MAC: a few dozen bytes); this is ample for that.
FRAME_OVERHEAD = 4096
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZmqConfig:
    curve: CurveConfig | None = None
    poll_interval_s: float = 0.02  # receiver: longest sleep before acking transfers the engine thread ended
    send_hwm: int = 100_000  # messages queued per peer before a send fails
    recv_hwm: int = 10_000
    io_threads: int = 1
    max_frame_bytes: int = 1 << 20  # longer runs are cut into frames of at most this
    handshake_timeout_s: float = 10.0  # torch.distributed pairing

    def __post_init__(self) -> None:
        if min(self.poll_interval_s, self.send_hwm, self.recv_hwm, self.io_threads, self.max_frame_bytes) <= 0:
            raise ValueError("zmq config: intervals, hwm, io_threads and max_frame_bytes must be positive")


def _bind_address(endpoint: str) -> str:
    """tcp://host:0 asks for a free port (ZeroMQ spells that `*`)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


# -- page movers ----------------------------------------------------------------------

Reply = Callable[[Header], None]  # send a header back to the peer a control message came from


class PageReceiver(Protocol):
    """The receiving half of a page mover; every method runs on the receiver thread."""

    transport: str  # the transport's name, as transfer plans carry it
    host_buffers: bool  # page bytes land through CPU memory (True) or on the KV tensor's device

    def start(self, channel: "ReceiverChannel") -> None:
        """After the channel has bound its socket (raising fails `start()`)."""

    def take(self, h: PagesHeader, peer: bytes, src: FrameSource) -> None:
        """Land the runs `h` announces (through `channel.inbox.pages`), reading any
        frames that follow it from `src`; WireError when the bytes do not match."""

    def control(self, peer: bytes, header: Header, reply: Reply) -> None:
        """A message that is not pages, final or abort; WireError if not the mover's."""

    def stop(self) -> None:
        """Before the channel's socket closes."""


class PageSender(Protocol):
    """The sending half of a page mover; engine thread only."""

    transport: str
    via: str  # what pages headers say the runs travel as ("frames", "p2p")

    def connect(self, channel: "SenderChannel", out: Export) -> None:
        """A transfer to `out.endpoint` opens (the p2p mover pairs on first use)."""

    def payloads(self, runs: Sequence[tuple[int, torch.Tensor]], layout: PageLayout) -> tuple[list[tuple[int, int]], list]:
        """The header's runs (first index, count) and what carries their bytes."""

    def send(self, channel: "SenderChannel", out: Export, header: bytes, payloads: list) -> None:
        """Send the encoded header over the channel and the payloads their way."""

    def poll(self) -> list[AckHeader]:
        """Failed acks of transfers whose bytes could not be sent (none for frames)."""

    def forget(self, endpoint: str) -> None: ...

    def close(self) -> None: ...


# -- receiver -------------------------------------------------------------------------


class _KeyCheck:
    """ZAP credentials provider: admit only authorized client keys, count the refused."""

    def __init__(self, keys: frozenset[bytes], counter: Counter[str]) -> None:
        self.keys, self.counter = keys, counter

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            self.counter["refused_peers"] += 1
        return ok


class ReceiverChannel:
    """Decode side: a ROUTER socket bound to `bind` (tcp://host:0 picks a free port, or
    ipc://path), served by one thread that hands page bytes to `pages`, writes nothing
    outside the Inbox's rules, and acks senders."""

    def __init__(self, kv_cache: torch.Tensor, bind: str, config: ZmqConfig, pages: PageReceiver) -> None:
        if config.curve is not None and not config.curve.authorized_keys:
            raise ValueError("curve.authorized_keys: a CURVE receiver needs the senders' public keys")
        self.inbox = Inbox(kv_cache)
        self.layout: PageLayout = self.inbox.layout
        self.config = config
        self.pages = pages
        self._bind = bind
        self._endpoint: str | None = None
        self._events: deque[TransferEvent] = deque()
        self._counters: Counter[str] = Counter()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        # Told (on the receiver thread, without arguments) when `events()` has news, so
        # an engine loop idling between polls can wake up at once. Must not block.
        self.on_events: Callable[[], None] | None = None

    # -- engine thread -----------------------------------------------------------

    def start(self) -> str:
        """Bind and start serving; returns the endpoint senders connect to."""
        self._thread.start()
        if not self._ready.wait(30):
            raise TransferError("receiver: did not start within 30 s")
        if self._error is not None:
            raise TransferError(f"receiver: cannot bind {self._bind}: {self._error}") from self._error
        return self.endpoint

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("receiver: not started")
        return self._endpoint

    @property
    def server_key(self) -> bytes | None:
        return self.config.curve.public_key if self.config.curve else None

    @property
    def transport(self) -> str:
        return self.pages.transport

    @property
    def host_buffers(self) -> bool:
        return self.pages.host_buffers

    def expect(self, transfer: Transfer) -> None:
        """Pages of blocks [skip, len(block_ids)) of a reservation will arrive, proving
        its secret (and maybe a head state of its `draft` layout). No deadline here: the
        reservation's owner cancels it when it gives up."""
        self.inbox.expect(transfer)

    @property
    def max_message_bytes(self) -> int:
        """The longest frame a sender may send here (its MAXMSGSIZE): a header, or one
        frame of a run (at most `max_frame_bytes`, or a single page when a page is
        longer), with the transport's own framing on top."""
        return max(MAX_HEADER_BYTES, self.config.max_frame_bytes, self.layout.page_bytes) + FRAME_OVERHEAD

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Stop expecting pages for a request. True: nothing writes its blocks any more;
        False: a write is in flight, free the blocks on its failed event (see Inbox)."""
        return self.inbox.cancel(request_id, reason)

    def events(self) -> list[TransferEvent]:
        """Transfers that finished (done or failed) since the last call."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def receiving(self) -> list[str]:
        """Transfers whose pages began to land since the last call."""
        return self.inbox.take_started()

    def stats(self) -> dict[str, int]:
        with self.inbox.lock:
            out = {f"rejected_{k}": v for k, v in self.inbox.rejected.items()}
            out["rejected"] = sum(self.inbox.rejected.values())
            out.update(self.inbox.stats)
        out.update(self._counters)
        return out

    def close(self) -> None:
        """Stop serving; every reservation still waiting fails (see `events()`)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for request_id in self.inbox.pending():
            self.inbox.cancel(request_id, "receiver closed")
        events = self.inbox.take_events()
        self._events.extend(events)
        if events:
            self._notify()

    def __enter__(self) -> "ReceiverChannel":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- receiver thread ---------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context(self.config.io_threads)
        auth = None
        sock = None
        try:
            sock = ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.rcvhwm = self.config.recv_hwm
            sock.sndhwm = self.config.send_hwm
            sock.maxmsgsize = self.max_message_bytes
            if self.config.curve is not None:
                auth = ThreadAuthenticator(ctx)
                auth.start()
                auth.configure_curve_callback(ZAP_DOMAIN, _KeyCheck(self.config.curve.authorized_keys, self._counters))
                sock.zap_domain = ZAP_DOMAIN.encode()
                sock.curve_secretkey = self.config.curve.secret_key
                sock.curve_publickey = self.config.curve.public_key
                sock.curve_server = True
            sock.bind(_bind_address(self._bind))
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.pages.start(self)
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()
            self._teardown(ctx, sock, auth)
            return
        self._ready.set()
        try:
            self._serve(sock)
        finally:
            self._teardown(ctx, sock, auth)

    def _teardown(self, ctx: zmq.Context, sock: zmq.Socket | None, auth: ThreadAuthenticator | None) -> None:
        self.pages.stop()
        if sock is not None:
            sock.close(0)
        if auth is not None:
            auth.stop()
        ctx.term()

    def _serve(self, sock: zmq.Socket) -> None:
        wait_ms = int(self.config.poll_interval_s * 1000) + 1
        while not self._stop.is_set():
            if sock.poll(wait_ms, zmq.POLLIN):
                for _ in range(256):  # then publish what the engine thread ended meanwhile
                    if not self._serve_one(sock):
                        break
            self._publish(sock)

    def _serve_one(self, sock: zmq.Socket) -> bool:
        """Handle one message; False when none is waiting. Never raises on bad input."""
        try:
            identity = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        src = SocketFrames(sock)
        try:
            control = deliver(self.inbox, identity, src, lambda h: self.pages.take(h, identity, src))
            if control is not None:
                self.pages.control(identity, control, lambda reply: sock.send_multipart([identity, encode(reply)], zmq.NOBLOCK))
        except WireError as exc:
            self.inbox.reject(exc.reason)
        except TransferError:
            self.inbox.reject("transport_error")
        except Exception:  # a bug must not take the receiver down with it
            log.exception("kv receiver: unexpected error on a message")
            self.inbox.reject("internal_error")
        finally:
            src.discard()
        if self.inbox.has_events():
            self._publish(sock)
        return True

    def _publish(self, sock: zmq.Socket) -> None:
        """Ack senders of finished transfers and hand the events to the engine thread."""
        events = self.inbox.take_events()
        acks = [(e.peer, AckHeader(e.request_id, e.ok, e.reason)) for e in events if e.peer is not None]
        for peer, ack in [*acks, *self.inbox.take_replies()]:
            try:
                sock.send_multipart([peer, encode(ack)], zmq.NOBLOCK)
            except zmq.ZMQError:
                self._counters["acks_dropped"] += 1
        for event in events:
            self._events.append(event)
        if events:
            self._notify()

    def _notify(self) -> None:
        if self.on_events is not None:
            try:
                self.on_events()
            except Exception:  # the receiver thread must go on
                log.exception("kv receiver: on_events failed")


class SocketFrames:
    """The rest of the message being read from a socket, as a FrameSource."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def next_frame(self) -> bytes:
        return self.sock.recv()

    def recv_into(self, buf: memoryview) -> int:
        return self.sock.recv_into(buf)

    def discard(self) -> None:
        """Drop what is left of the message without copying it."""
        empty = bytearray()
        while self.more():
            self.sock.recv_into(empty)


# -- sender ---------------------------------------------------------------------------


class SenderChannel:
    """Prefill side: one DEALER socket per receiver endpoint, page bytes sent by `pages`.
    Engine thread only."""

    def __init__(self, config: ZmqConfig, pages: PageSender) -> None:
        self.config = config
        self.pages = pages
        self._ctx = zmq.Context(config.io_threads)
        self._socks: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._acks: list[AckHeader] = []
        self.counters: Counter[str] = Counter()

    @property
    def transport(self) -> str:
        return self.pages.transport

    def open(self, request_id: str, endpoint: str, server_key: bytes | None = None, *, secret: bytes) -> Export:
        """Start a transfer to `endpoint`; its messages prove the reservation's `secret`."""
        out = Export(request_id, endpoint, check_secret(secret), server_key)
        self._socket(out)
        self.pages.connect(self, out)
        return out

    def send_pages(self, out: Export, layer: int, runs: Sequence[tuple[int, torch.Tensor]], layout: PageLayout) -> int:
        """Send one layer's runs (first block index, pages tensor [n, 2, bs, H, D]) as one
        message; returns the page bytes sent. Raises TransferError if the peer stalls."""
        if not runs:
            return 0
        spans, payloads = self.pages.payloads(runs, layout)
        nbytes = [count * layout.page_bytes for _, count in spans]
        header = PagesHeader(out.request_id, out.seq, layer, tuple(spans), tuple(nbytes),
                             layout.dtype, layout.wire_page, self.pages.via)
        self.pages.send(self, out, encode(sign(header, out.secret)), payloads)
        out.seq += 1
        out.nbytes += sum(nbytes)
        self.counters["bytes"] += sum(nbytes)
        self.counters["messages"] += 1
        return sum(nbytes)

    def send_final(self, out: Export, num_tokens: int, digest: bytes, first_tokens: Sequence[int],
                   draft: DraftState | None = None) -> None:
        """The last message; `draft` (an EAGLE head's state for the prompt) follows the
        header in frames of at most max_frame_bytes (wire.py)."""
        self.send(out, final_message(out.request_id, out.seq, out.secret, num_tokens, digest, first_tokens, draft,
                                     self.config.max_frame_bytes))
        out.seq += 1

    def send_abort(self, out: Export, reason: str) -> None:
        """Best effort: tell the receiver to give up now rather than when its owner does."""
        try:
            self.send(out, abort_message(out.request_id, out.secret, reason))
        except TransferError:
            pass

    def poll(self, timeout_s: float = 0.0) -> list[AckHeader]:
        """Acks that arrived since the last call, waiting up to `timeout_s` for one (and
        a failed ack for each transfer whose page bytes could not be sent)."""
        acks, self._acks = self._acks, []
        wait = 0 if acks or timeout_s <= 0 else max(1, int(timeout_s * 1000))
        for sock, _ in self._poller.poll(wait):
            self._drain_acks(sock, acks)
        return acks + self.pages.poll()

    def forget(self, endpoint: str) -> None:
        """Close the connection to a receiver (dropping anything still queued)."""
        self.pages.forget(endpoint)
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            self._poller.unregister(sock)
            sock.close(0)

    def close(self) -> None:
        for endpoint in list(self._socks):
            self.forget(endpoint)
        self.pages.close()
        self._ctx.term()

    # -- for page movers ---------------------------------------------------------

    def send(self, out: Export, frames: list[Any]) -> None:
        """One message to the transfer's receiver, without blocking."""
        sock = self._socket(out)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            self.counters["send_stalled"] += 1
            raise TransferError(f"{out.endpoint}: receiver is not draining (high-water mark)") from exc
        except zmq.ZMQError as exc:
            raise TransferError(f"{out.endpoint}: send failed: {exc}") from exc

    def exchange(self, out: Export, frames: list[Any], answer: Callable[[Header], bool], timeout_s: float) -> Header | None:
        """Send a request and wait up to `timeout_s` for the reply `answer` accepts (None
        if none came); acks arriving meanwhile are kept for `poll`, anything else dropped."""
        sock = self._socket(out)
        self.send(out, frames)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                return None
            reply = sock.recv_multipart()
            try:
                header = decode(reply[0])
            except WireError:
                continue
            if isinstance(header, AckHeader):
                self._acks.append(header)
            elif answer(header):
                return header

    # -- internals ---------------------------------------------------------------

    def _socket(self, out: Export) -> zmq.Socket:
        sock = self._socks.get(out.endpoint)
        if sock is not None:
            return sock
        curve = self.config.curve
        if curve is None and out.server_key is not None:
            raise ValueError(f"server_key: the receiver at {out.endpoint} requires CURVE and this sender has no keys")
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = self.config.send_hwm
        sock.maxmsgsize = MAX_HEADER_BYTES + FRAME_OVERHEAD  # only acks (and welcomes) come back
        if curve is not None:
            server_key = out.server_key or curve.server_key
            if server_key is None:
                sock.close(0)
                raise ValueError(f"server_key: CURVE is on but no public key is known for {out.endpoint}")
            sock.curve_secretkey = curve.secret_key
            sock.curve_publickey = curve.public_key
            sock.curve_serverkey = server_key
        try:
            sock.connect(out.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise TransferError(f"endpoint: cannot connect to {out.endpoint!r}: {exc}") from exc
        self._socks[out.endpoint] = sock
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _drain_acks(self, sock: zmq.Socket, acks: list[AckHeader]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header = decode(frames[0]) if len(frames) == 1 else None
            except WireError:
                header = None
            if isinstance(header, AckHeader):
                acks.append(header)
            else:
                self.counters["rejected_replies"] += 1

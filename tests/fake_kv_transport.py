"""An in-process KV transport for kvtransfer's unit tests (vLLM's
tests/v1/kv_connector/unit is the model): a `FakeSender` and a `FakeReceiver`
implementing connector.py's Sender / Receiver Protocols, passing each message's
frames in memory through a `FakeNetwork`, with the real frame format (wire.py) and
the real receiver state machine (inbox.py). No sockets, no threads of its own, no
services.

    FakeSender.send_pages ──frames──> FakeNetwork ──deliver──> FakeReceiver.inbox
    FakeSender.poll  <──────acks────  FakeNetwork <──events──  FakeReceiver.events

Delivery is synchronous (the caller's thread plays the receiver's), unless the
network is told to `hold` a request's messages: then `release` delivers them later,
from any thread, and a `Gate` can stop a write half-way (pages landing) until it
is opened.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.spec.draft_state import DraftState
from pdserve.kvtransfer.inbox import Inbox, TransferEvent, deliver
from pdserve.kvtransfer.transfer import Export, Transfer
from pdserve.kvtransfer.wire import (
    AckHeader,
    PageLayout,
    PagesHeader,
    TransferError,
    WireError,
    abort_message,
    as_bytes_view,
    check_secret,
    encode,
    final_message,
    sign,
)

if TYPE_CHECKING:
    from pdserve.kvtransfer.connector import Transport
    from pdserve.kvtransfer.registry import TransportContext

TRANSPORT = "fake"


class Frames:
    """A FrameSource over a list of frames (ZeroMQ's recv_into semantics); `gate`, if
    given, is waited on before the first page frame lands (a write in flight)."""

    def __init__(self, frames: list[bytes], gate: "Gate | None" = None) -> None:
        self.frames = list(frames)
        self.gate = gate

    def more(self) -> bool:
        return bool(self.frames)

    def next_frame(self) -> bytes:
        return self.frames.pop(0)

    def recv_into(self, buf: memoryview) -> int:
        if self.gate is not None:
            self.gate.pass_through()
            self.gate = None
        frame = self.frames.pop(0)
        n = min(len(frame), len(buf))
        buf[:n] = frame[:n]
        return len(frame)


class Gate:
    """Stops a receiver's write half-way: `entered` is set once bytes began to land,
    and the write goes on only after `open`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def pass_through(self) -> None:
        self.entered.set()
        if not self._open.wait(10):
            raise TimeoutError("gate never opened")

    def open(self) -> None:
        self._open.set()


class FakeNetwork:
    """Endpoints to receivers, peers to senders; messages as lists of frames."""

    def __init__(self) -> None:
        self.receivers: dict[str, FakeReceiver] = {}
        self.senders: dict[bytes, FakeSender] = {}
        self.held: dict[str, list[tuple[str, bytes, list[bytes]]]] = {}  # request id -> messages not yet delivered
        self.rejected: list[str] = []  # the receiver's reasons for refused messages, in order

    def hold(self, request_id: str) -> None:
        self.held.setdefault(request_id, [])

    def release(self, request_id: str, gate: Gate | None = None) -> None:
        """Deliver a held request's messages, the first one through `gate`."""
        for endpoint, peer, frames in self.held.pop(request_id, []):
            self._deliver(endpoint, peer, frames, gate)
            gate = None

    def send(self, endpoint: str, peer: bytes, request_id: str, frames: list[bytes]) -> None:
        if endpoint not in self.receivers:
            raise TransferError(f"{endpoint}: no receiver there")
        if request_id in self.held:
            self.held[request_id].append((endpoint, peer, frames))
        else:
            self._deliver(endpoint, peer, frames, None)

    def ack(self, peer: bytes, ack: AckHeader) -> None:
        sender = self.senders.get(peer)
        if sender is not None:
            sender.acks.append(ack)

    def _deliver(self, endpoint: str, peer: bytes, frames: list[bytes], gate: Gate | None) -> None:
        receiver = self.receivers[endpoint]
        try:
            deliver(receiver.inbox, peer, Frames(frames, gate))
        except WireError as exc:
            receiver.inbox.reject(exc.reason)
            self.rejected.append(exc.reason)
        receiver.publish()


class FakeReceiver:
    """connector.Receiver over an Inbox, fed by a FakeNetwork."""

    transport = TRANSPORT
    server_key = None

    def __init__(self, network: FakeNetwork, kv_cache: torch.Tensor, endpoint: str = "fake://decode") -> None:
        self.network = network
        self.inbox = Inbox(kv_cache)
        self.endpoint = endpoint
        self.on_events = None
        self._events: list[TransferEvent] = []
        self._lock = threading.Lock()
        network.receivers[endpoint] = self

    def start(self) -> str:
        return self.endpoint

    def expect(self, transfer: Transfer) -> None:
        self.inbox.expect(transfer)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        return self.inbox.cancel(request_id, reason)

    def publish(self) -> None:
        """What the transport's thread does after each message: ack senders, hand the
        events to the engine thread."""
        events = self.inbox.take_events()
        for event in events:
            if event.peer is not None:
                self.network.ack(event.peer, AckHeader(event.request_id, event.ok, event.reason))
        for peer, reply in self.inbox.take_replies():
            self.network.ack(peer, reply)
        with self._lock:
            self._events.extend(events)

    def events(self) -> list[TransferEvent]:
        self.publish()  # a cancel on the engine thread ends a transfer without a message
        with self._lock:
            events, self._events = self._events, []
        return events

    def receiving(self) -> list[str]:
        return self.inbox.take_started()

    def stats(self) -> dict[str, int]:
        with self.inbox.lock:
            return {**self.inbox.stats, "rejected": sum(self.inbox.rejected.values())}

    def close(self) -> None:
        for request_id in self.inbox.pending():
            self.inbox.cancel(request_id, "receiver closed")
        self.network.receivers.pop(self.endpoint, None)


class FakeSender:
    """connector.Sender: the real headers, signed, each run's pages as one frame."""

    transport = TRANSPORT

    def __init__(self, network: FakeNetwork, peer: bytes = b"prefill-1") -> None:
        self.network = network
        self.peer = peer
        self.acks: list[AckHeader] = []
        self.counters: Counter[str] = Counter()
        network.senders[peer] = self

    def open(self, request_id: str, endpoint: str, server_key: bytes | None = None, *, secret: bytes) -> Export:
        if endpoint not in self.network.receivers:
            raise TransferError(f"{endpoint}: no receiver there")
        return Export(request_id, endpoint, check_secret(secret), server_key)

    def send_pages(self, out: Export, layer: int, runs: Sequence[tuple[int, torch.Tensor]], layout: PageLayout) -> int:
        if not runs:
            return 0
        spans = tuple((first, pages.shape[0]) for first, pages in runs)
        nbytes = tuple(count * layout.page_bytes for _, count in spans)
        header = PagesHeader(out.request_id, out.seq, layer, spans, nbytes, layout.dtype, layout.wire_page)
        frames = [bytes(as_bytes_view(pages.contiguous())) for _, pages in runs]
        self._send(out, [encode(sign(header, out.secret)), *frames])
        out.seq += 1
        out.nbytes += sum(nbytes)
        self.counters["messages"] += 1
        return sum(nbytes)

    def send_final(self, out: Export, num_tokens: int, digest: bytes, first_tokens: Sequence[int],
                   draft: DraftState | None = None) -> None:
        self._send(out, final_message(out.request_id, out.seq, out.secret, num_tokens, digest, first_tokens, draft,
                                      1 << 20))
        out.seq += 1

    def send_abort(self, out: Export, reason: str) -> None:
        try:
            self._send(out, abort_message(out.request_id, out.secret, reason))
        except TransferError:
            pass

    def poll(self, timeout_s: float = 0.0) -> list[AckHeader]:
        acks, self.acks = self.acks, []
        return acks

    def close(self) -> None:
        self.network.senders.pop(self.peer, None)

    def _send(self, out: Export, frames: list[bytes]) -> None:
        self.network.send(out.endpoint, self.peer, out.request_id, frames)


def plugin(ctx: TransportContext) -> Transport:
    """A registry plug-in (`--kv-connector fake_kv_transport:plugin`): this module's
    sides for the context's role, on a network of their own."""
    from pdserve.kvtransfer.connector import Transport

    network = FakeNetwork()
    sender = FakeSender(network, ctx.worker_id.encode()) if ctx.role != "decode" else None
    receiver = FakeReceiver(network, ctx.kv_cache, f"fake://{ctx.worker_id}") if ctx.role != "prefill" else None
    return Transport(sender, receiver, f"fake-sender:{ctx.worker_id}")

"""ZeroMQ transport for KV pages, over tcp:// or ipc://: the control channel
(kvtransfer/transports/channel.py) with page bytes as frames of the header's own message.

    prefill worker                                  decode worker
    ZmqSender  DEALER --[header | run | run ..]-->  ROUTER  ZmqReceiver (one thread)
               DEALER <--------- [ack] -----------  ROUTER

Sending is zero-copy: each run of consecutive blocks is a frame made straight from the
KV tensor's memory (buffer protocol, copy=False); ZeroMQ's I/O thread writes it to the
socket while the engine computes the next layer. Receiving goes straight into the
decode worker's reserved blocks with `recv_into` (no Python bytes objects for page
data). The engine must therefore not release sent blocks before the receiver has
acknowledged them, or the lease ran out.

CURVE, the ZAP check, high-water marks and the frame-size limit are the channel's
(see kvtransfer/transports/channel.py); the keys are kvtransfer/transports/curve.py's `CurveConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import zmq  # noqa: F401  (pyzmq, not this module: the name must never shadow it; see tests)

from pdserve.kvtransfer.inbox import FrameSource, Inbox, fill_frames
from pdserve.kvtransfer.transfer import Export
from pdserve.kvtransfer.transports.channel import ReceiverChannel, Reply, SenderChannel, ZmqConfig
from pdserve.kvtransfer.transports.curve import CurveConfig
from pdserve.kvtransfer.wire import AckHeader, Header, PageLayout, PagesHeader, WireError, as_bytes_view

__all__ = ["CurveConfig", "FramePageReceiver", "FramePageSender", "ZmqConfig", "ZmqReceiver", "ZmqSender"]


class FramePageReceiver:
    """Page bytes as the frames after their header, copied straight into the landings."""

    transport = "zmq"
    host_buffers = True  # page bytes are copied by recv_into, so landings are CPU memory

    def __init__(self) -> None:
        self._inbox: Inbox | None = None

    def start(self, channel: ReceiverChannel) -> None:
        self._inbox = channel.inbox

    def take(self, h: PagesHeader, peer: bytes, src: FrameSource) -> None:
        if h.via != "frames":
            raise WireError("bad_header", f"via {h.via!r}: this receiver takes pages as frames only")
        with self._inbox.pages(h, peer, host=True) as landings:
            fill_frames(src, landings)

    def control(self, peer: bytes, header: Header, reply: Reply) -> None:
        raise WireError("bad_kind", f"{header.kind} is not accepted by a receiver")

    def stop(self) -> None:
        pass


class FramePageSender:
    """Page bytes as frames of the header's message: zero-copy views of the KV memory."""

    transport = "zmq"
    via = "frames"

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes

    def connect(self, channel: SenderChannel, out: Export) -> None:
        pass

    def payloads(self, runs: Sequence[tuple[int, torch.Tensor]], layout: PageLayout) -> tuple[list[tuple[int, int]], list]:
        """Frames for the runs, cut to at most `max_frame_bytes` each: the receiver
        copies a frame out of ZeroMQ's buffer while it is still in cache (cheaper than
        from memory), and frames stay big enough for the per-frame cost to vanish."""
        per_frame = max(1, self.max_frame_bytes // layout.page_bytes)
        page = layout.page_bytes
        spans, frames = [], []
        for first, pages in runs:
            view = as_bytes_view(pages if pages.device.type == "cpu" else pages.cpu())
            n = pages.shape[0]
            for k in range(0, n, per_frame):
                count = min(per_frame, n - k)
                spans.append((first + k, count))
                frames.append(view[k * page : (k + count) * page])
        return spans, frames

    def send(self, channel: SenderChannel, out: Export, header: bytes, payloads: list) -> None:
        channel.send(out, [header, *payloads])

    def poll(self) -> list[AckHeader]:
        return []

    def forget(self, endpoint: str) -> None:
        pass

    def close(self) -> None:
        pass


class ZmqReceiver(ReceiverChannel):
    """Decode side: the control channel with frame pages."""

    def __init__(self, kv_cache: torch.Tensor, bind: str, config: ZmqConfig = ZmqConfig()) -> None:
        super().__init__(kv_cache, bind, config, FramePageReceiver())


class ZmqSender(SenderChannel):
    """Prefill side: the control channel with frame pages. Engine thread only."""

    def __init__(self, config: ZmqConfig = ZmqConfig()) -> None:
        super().__init__(config, FramePageSender(config.max_frame_bytes))

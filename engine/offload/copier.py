"""Copies of one block between the device pool's KV tensor and host memory.

    to_host(block_id, dst, ready)   device block (every layer, K and V) -> a host tensor
    to_device(src, block_id)        a host tensor -> device block

Bytes move as stored (uint8 views: float8 pages are never converted). On a GPU the
copy down runs on a side stream of its own, after the event the engine thread
recorded when it queued the block (`ready`: every kernel that wrote the block has
run), and the worker thread waits for it there, never the engine thread; on a CPU
both are plain memory copies.
"""

from __future__ import annotations

from typing import Any

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def as_view(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes (for a file), without a copy when it is contiguous."""
    return memoryview(as_bytes(t.contiguous()).reshape(-1).numpy())


class BlockCopier:
    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def mark(self) -> Any:
        """What a copy down of a block written so far must wait for (None on a CPU)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def to_host(self, block_id: int, dst: torch.Tensor, ready: Any = None) -> None:
        src = as_bytes(self.kv_cache[:, block_id])
        if self._stream is None:
            as_bytes(dst).copy_(src)
            return
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            as_bytes(dst).copy_(src, non_blocking=True)
        self._stream.synchronize()

    def to_device(self, src: torch.Tensor, block_id: int) -> None:
        """Synchronous: the source (a host slot, a file's buffer) may be reused at return."""
        dst = as_bytes(self.kv_cache[:, block_id])
        dst.copy_(as_bytes(src).reshape(dst.shape))

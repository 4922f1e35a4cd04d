"""What the KV tier tests share: a small layout, blocks of recognisable bytes."""

from __future__ import annotations

import hashlib

import torch

from pdserve.engine.offload.layout import KVLayout

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block size, kv heads, head dim
LAYOUT = KVLayout("float32", "weights=float32", "model-a", 4, SHAPE)
OTHER_LAYOUT = KVLayout("float32", "weights=float32", "model-b", 4, SHAPE)


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def tokens(i: int) -> tuple[int, ...]:
    return (i, i + 1, i + 2, i + 3)


def block_data(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[-1], dtype=torch.float32)


def as_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())

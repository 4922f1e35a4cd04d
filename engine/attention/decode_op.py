"""Paged decode attention as one opaque operator, for the captured decode step (engine/captured.py).

A compiled graph cannot hold the KV cache's write (an in-place update of a tensor far
larger than the step) or the page gather (its length follows the sequences) as traced
code: Inductor would copy the cache, or recompile per context length. So the compiled
step calls `pdserve::paged_decode_attention`, registered with torch.library as an
operator that mutates the cache: the graph keeps it as one call per layer.

What the call needs beyond q/k/v and the layer's cache has shapes that change every
step (the real sequences, their pages, the mask), so it travels in a `DecodeStep`, an
opaque object the graph passes by reference: the runner fills it once per step, and
every layer reads the same tensors (masks are built once per sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from pdserve.engine.attention.base import AttentionBackend, write_kv
from pdserve.engine.attention.torch_ref import KVReader, masked_attention


class DecodeStep(OpaqueBase):
    """One captured step's sequences, host-built once per step (reused across steps).

        num_seqs   n real sequences (the bucket's rows n.. are padding)
        k_rows     [n] row of each new K in a layer cache viewed as rows (base.kv_rows)
        block_ids  [n * W] each sequence's first W pages, W = the longest one's count
        seq_lens   [n] tokens in cache after this step's write
    """

    def __init__(self) -> None:
        self.num_seqs = 0
        self.max_len = 0
        self.width = 0
        self.k_rows = torch.empty(0, dtype=torch.long)
        self.block_ids = torch.empty(0, dtype=torch.long)
        self.seq_lens = torch.empty(0, dtype=torch.long)
        self._masks: dict[int | None, torch.Tensor] = {}

    def set(self, k_rows: torch.Tensor, block_ids: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """A new step: `block_ids` [n, W], `seq_lens` [n] (int64)."""
        self.num_seqs, self.width = block_ids.shape
        self.max_len = int(seq_lens.max()) if self.num_seqs else 0
        self.k_rows = k_rows
        self.block_ids = block_ids.flatten()
        self.seq_lens = seq_lens
        self._masks = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, 1, 1, max_len]: True where a sequence's query (its last position) sees a key."""
        if window not in self._masks:
            pos = torch.arange(self.max_len, device=self.seq_lens.device)[None, :]
            last = self.seq_lens[:, None] - 1
            mask = pos <= last
            if window is not None:
                mask &= pos > last - window
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]


register_opaque_type(DecodeStep, typ="reference")


@dataclass(frozen=True)
class DecodeMeta:
    """A captured step's attention metadata, what `CapturedAttention` reads."""

    step: DecodeStep
    block_size: int


@torch.library.custom_op("pdserve::paged_decode_attention", mutates_args=("kv",))
def paged_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, step: DecodeStep, block_size: int,
    scale: float, window: int | None, k_scale: float, v_scale: float, softcap: float | None,
) -> torch.Tensor:
    """Write the step's n real rows of K/V into `kv` (one layer's cache [blocks, 2, BS,
    KVH, D]) and attend each of those queries q [B, H, D] over its cached K/V; rows n..
    of the output are zeros."""
    n = step.num_seqs
    out = torch.zeros_like(q) if n < q.shape[0] else torch.empty_like(q)
    if n == 0:
        return out
    write_kv(k[:n], v[:n], kv, step.k_rows, block_size, (k_scale, v_scale))
    read = KVReader(kv.dtype, q.dtype, (k_scale, v_scale))
    shape = (n, step.width * block_size, *kv.shape[3:])
    keys = read.raw(kv[:, 0]).index_select(0, step.block_ids).view(shape)[:, : step.max_len]  # [n, L, KVH, D]
    vals = read.raw(kv[:, 1]).index_select(0, step.block_ids).view(shape)[:, : step.max_len]
    keys, vals = read.pair(keys, vals)
    # the H / KVH query heads sharing a KV head attend as that head's "queries": one call
    _, num_heads, head_dim = q.shape
    num_kv = keys.shape[2]
    qg = q[:n].view(n, num_kv, num_heads // num_kv, head_dim)
    o = masked_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), step.mask(window), scale, softcap)
    out[:n] = o.reshape(n, num_heads, head_dim)
    return out


@paged_decode_attention.register_fake
def _(q, k, v, kv, step, block_size, scale, window, k_scale, v_scale, softcap):
    return torch.empty_like(q)


class CapturedAttention(AttentionBackend):
    """The attention backend a captured decode step runs: `paged_decode_attention` on a `DecodeMeta`."""

    name = "captured"

    def forward(self, q, k, v, kv, meta, scale: float, sliding_window: int | None,
                kv_scales: tuple[float, float] = (1.0, 1.0), softcap: float | None = None):
        if not isinstance(meta, DecodeMeta):
            raise TypeError(f"captured attention: needs a DecodeMeta, got {type(meta).__name__}")
        return paged_decode_attention(
            q, k, v, kv, meta.step, meta.block_size, float(scale), sliding_window, float(kv_scales[0]),
            float(kv_scales[1]), None if softcap is None else float(softcap))

"""Paged decode attention as one opaque operator, for the captured decode step (engine/captured.py).

A compiled graph cannot hold the KV cache's write (an in-place update of a tensor far
larger than the step) or the page gather (its length follows the sequences) as traced
code: Inductor would copy the cache, or recompile per context length. So the compiled
step calls `pdserve::paged_decode_attention`, registered with torch.library as an
operator that mutates the cache: the graph keeps it as one call, and it runs the torch
reference backend's decode path (attention/torch_ref.py) on tensors alone.

A captured step's batch is padded to its bucket's size. `DecodeMeta.info` holds
(real sequences, longest sequence) and is read inside the operator, not in the graph:
padded rows write nothing and attend to nothing, and their outputs are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import AttentionBackend, DecodeBatch, is_fp8, quantize_kv
from pdserve.engine.attention.torch_ref import KVReader, attend_decode_batch


@dataclass(frozen=True)
class DecodeMeta:
    """A captured decode step's attention metadata: tensors of the bucket's size B, held
    by the runner across steps (persistent buffers) and refilled each step.

        kv_rows       [B] int64   row of each new K in a layer cache viewed as rows (base.kv_rows)
        block_tables  [B, W] int32  W = blocks of the longest sequence the engine admits
        seq_lens      [B] int64   tokens in cache after this step's write
        info          [2] int64   (real sequences n <= B, the longest one's seq_len)
    """

    kv_rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    info: torch.Tensor
    block_size: int


@torch.library.custom_op("pdserve::paged_decode_attention", mutates_args=("kv",))
def paged_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, kv_rows: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, info: torch.Tensor, block_size: int, scale: float,
    window: int | None, k_scale: float, v_scale: float, softcap: float | None,
) -> torch.Tensor:
    """Write the first n rows' K/V into `kv` (one layer's cache), attend each of those
    queries (one per sequence) over its cached K/V; rows n.. of the output are zeros."""
    n, max_len = info.tolist()
    out = torch.zeros_like(q)
    if n == 0:
        return out
    new_k, new_v, rows_kv = k[:n], v[:n], kv
    if is_fp8(kv.dtype):
        new_k = quantize_kv(new_k, k_scale, kv.dtype).view(torch.uint8)
        new_v = quantize_kv(new_v, v_scale, kv.dtype).view(torch.uint8)
        rows_kv = kv.view(torch.uint8)
    rows = rows_kv.view(-1, *rows_kv.shape[3:])
    rows.index_copy_(0, kv_rows[:n], new_k)
    rows.index_copy_(0, kv_rows[:n] + block_size, new_v)
    index = torch.arange(n, device=q.device)
    decode = DecodeBatch(
        rows=index[:, None], picked=index, query_lens=torch.ones(n, dtype=torch.long, device=q.device),
        block_tables=block_tables[:n, : -(-max_len // block_size)], seq_lens=seq_lens[:n],
        max_seq_len=max_len, max_query_len=1,
    )
    read = KVReader(kv.dtype, q.dtype, (k_scale, v_scale))
    out[:n] = attend_decode_batch(q[:n, None], kv[:, 0], kv[:, 1], decode, scale, window, read, softcap)[:, 0]
    return out


@paged_decode_attention.register_fake
def _(q, k, v, kv, kv_rows, block_tables, seq_lens, info, block_size, scale, window, k_scale, v_scale, softcap):
    return torch.empty_like(q)


class CapturedAttention(AttentionBackend):
    """The attention backend a captured decode step runs: `paged_decode_attention` on a `DecodeMeta`."""

    name = "captured"

    def forward(self, q, k, v, kv, meta, scale: float, sliding_window: int | None,
                kv_scales: tuple[float, float] = (1.0, 1.0), softcap: float | None = None):
        if not isinstance(meta, DecodeMeta):
            raise TypeError(f"captured attention: needs a DecodeMeta, got {type(meta).__name__}")
        return paged_decode_attention(
            q, k.contiguous(), v.contiguous(), kv, meta.kv_rows, meta.block_tables, meta.seq_lens, meta.info,
            meta.block_size, float(scale), sliding_window, float(kv_scales[0]), float(kv_scales[1]),
            None if softcap is None else float(softcap))

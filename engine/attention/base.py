"""The attention interface every backend implements.

A step's batch is flattened: T tokens from B sequences, no padding.

    query_start_loc  [0, 5, 6, 9]        sequence b's queries are q[qsl[b]:qsl[b+1]]
    seq_lens         [5, 40, 3]          tokens in cache after this step's write
    block_tables     [B, max_blocks]     logical block -> physical block
    slot_mapping     [T]                 where each new token's K/V is written

A sequence's queries are the *last* q_len tokens of its context, so query j of
sequence b sits at position seq_lens[b] - q_len_b + j and attends causally to every
cached position up to it (within the layer's sliding window, if any).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch


# Sequences with at most this many queries (decode: 1; a verification of K drafts: K+1)
# are attended in one batched call, their queries padded to the longest one's count.
MAX_BATCHED_QUERIES = 16


@dataclass(frozen=True)
class DecodeBatch:
    """The step's sequences with few queries (decode, speculative verification), ready
    for one batched call. Built once per step (first use) and shared by every layer: no
    host sync per layer.

        rows    [S, Q]  query row in the flat batch of each sequence's query j (Q = the
                        most queries any of them has; a padded j repeats its last row)
        picked  [N]     the real (sequence, j) entries of rows.flatten(), N = their count
    """

    rows: torch.Tensor  # [S, Q] int64
    picked: torch.Tensor  # [N] int64
    query_lens: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, blocks] cut to the longest one's blocks
    seq_lens: torch.Tensor  # [S] int64
    max_seq_len: int
    max_query_len: int


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    # [T] row of each new token's K in the layer cache viewed as [NB * 2 * BS, KVH, D];
    # its V sits block_size rows further (see write_kv)
    kv_rows: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies for backends that loop over sequences.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    query_start_loc_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def decode_batch(self) -> DecodeBatch | None:
        """The sequences with 1..MAX_BATCHED_QUERIES queries when there are two or more, or
        one with several queries after cached context (else None: a lone decode query or a
        prompt is attended on its own)."""
        seqs = [b for b, n in enumerate(self.query_lens_cpu) if 0 < n <= MAX_BATCHED_QUERIES]
        if not seqs or (len(seqs) == 1 and (self.query_lens_cpu[seqs[0]] == 1
                                            or self.query_lens_cpu[seqs[0]] == self.seq_lens_cpu[seqs[0]])):
            return None
        device = self.seq_lens.device
        index = torch.tensor(seqs, device=device)
        max_len = max(self.seq_lens_cpu[b] for b in seqs)
        max_q = max(self.query_lens_cpu[b] for b in seqs)
        rows = [[self.query_start_loc_cpu[b] + min(j, self.query_lens_cpu[b] - 1) for j in range(max_q)] for b in seqs]
        q_lens = [self.query_lens_cpu[b] for b in seqs]
        return DecodeBatch(
            rows=torch.tensor(rows, device=device),
            picked=torch.tensor([i * max_q + j for i, n in enumerate(q_lens) for j in range(n)], device=device),
            query_lens=torch.tensor(q_lens, device=device),
            block_tables=self.block_tables.index_select(0, index)[:, : -(-max_len // self.block_size)],
            seq_lens=self.seq_lens.index_select(0, index).to(torch.long),
            max_seq_len=max_len,
            max_query_len=max_q,
        )


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv: torch.Tensor,  # one layer's cache [num_blocks, 2, block_size, KVH, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache at `meta.slot_mapping`, then attend; returns [T, H, D].

        `softcap` (Gemma 2's attn_logit_softcapping): scores (already scaled) become
        tanh(s / cap) * cap before the mask and the softmax.

        A float8 cache (--kv-cache-dtype fp8*) holds K / k_scale and V / v_scale, clamped
        to the format's range (`kv_scales` = this layer's (k_scale, v_scale)); attention
        reads them back as value * scale, in every path (a fresh prompt too), so a
        sequence's output never depends on whether its K/V came from this step, the
        prefix cache or another worker."""


def kv_rows(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot (block * BS + offset) -> row of its K in a layer cache flattened to rows:

        [block 0: K slot 0..BS-1 | V slot 0..BS-1 | block 1: K ... | V ... ]
    """
    return (slot_mapping // block_size) * (2 * block_size) + slot_mapping % block_size


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in a float8 `dtype`, clamped first (a cast saturates to nan/inf otherwise)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values a float8 cache holds, as `dtype`."""
    return (x.float() * scale).to(dtype)


def round_trip_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """What reading back `x` from a cache of `cache_dtype` gives (x itself unless float8)."""
    if not is_fp8(cache_dtype):
        return x
    return dequantize_kv(quantize_kv(x, scale, cache_dtype), scale, x.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, k_rows: torch.Tensor, block_size: int,
             kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Store new K/V at `k_rows` (`kv_rows` of their slots; each V sits block_size rows
    further), one index_copy each: much faster than 2-D indexing; a float8 cache gets
    them quantized, written through a uint8 view (torch has no float8 index_copy)."""
    if is_fp8(kv.dtype):
        k = quantize_kv(k, kv_scales[0], kv.dtype).view(torch.uint8)
        v = quantize_kv(v, kv_scales[1], kv.dtype).view(torch.uint8)
        kv = kv.view(torch.uint8)
    rows = kv.view(-1, *kv.shape[3:])
    rows.index_copy_(0, k_rows, k)
    rows.index_copy_(0, k_rows + block_size, v)

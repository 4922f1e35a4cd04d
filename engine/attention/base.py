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

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    slot_blocks: torch.Tensor  # [T] slot_mapping // block_size
    slot_offsets: torch.Tensor  # [T] slot_mapping % block_size
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies for backends that loop over sequences.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (strided view)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write k/v into the cache at `meta.slot_mapping`, then attend; returns [T, H, D]."""


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v

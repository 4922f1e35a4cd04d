"""The reference attention backend: plain torch, runs anywhere.

Sequences with few queries (decode: one; speculative verification: K+1) are gathered
into one padded batch and attended in a single call; longer ones (prompts, chunks)
go one by one, and a fresh prefill (nothing cached before it) attends to its own K/V
directly. A layer with attention logit soft-capping (Gemma 2) takes the explicit
path transformers' eager attention takes (SDPA cannot cap scores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import (
    MAX_BATCHED_QUERIES, AttentionBackend, AttentionMetadata, DecodeBatch, dequantize_kv, is_fp8, round_trip_kv,
    write_kv,
)


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                kv_scales: tuple[float, float] = (1.0, 1.0), softcap: float | None = None):
        write_kv(k, v, kv, meta.kv_rows, meta.block_size, kv_scales)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        # A float8 cache is gathered as bytes and read back as value * scale.
        read = KVReader(kv.dtype, q.dtype, kv_scales)
        out = torch.empty_like(q)
        decode = meta.decode_batch
        if decode is not None:
            o = attend_decode_batch(q[decode.rows], k_cache, v_cache, decode, scale, sliding_window, read, softcap)
            out[decode.rows.flatten()[decode.picked]] = o.flatten(0, 1)[decode.picked]
        for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 0 or (decode is not None and q_len <= MAX_BATCHED_QUERIES):
                continue
            s = meta.query_start_loc_cpu[b]
            if q_len == seq_len:  # nothing cached before: attend to the fresh K/V (as the cache holds them)
                kb, vb = read.fresh(k[s : s + q_len], v[s : s + q_len])
            else:
                kb, vb = read.pair(*gather_kv(read.raw(k_cache), read.raw(v_cache), meta.block_tables[b], seq_len))
            out[s : s + q_len] = _attend(q[s : s + q_len], kb, vb, scale, sliding_window, softcap)
        return out

class KVReader:
    """Reads a layer's cache as the compute dtype: a float8 cache through its scales."""

    def __init__(self, cache_dtype: torch.dtype, dtype: torch.dtype, scales: tuple[float, float]) -> None:
        self.cache_dtype, self.dtype, self.scales = cache_dtype, dtype, scales
        self.fp8 = is_fp8(cache_dtype)

    def raw(self, cache: torch.Tensor) -> torch.Tensor:
        # index_select has no float8 kernel: gather bytes, reinterpret after
        return cache.view(torch.uint8) if self.fp8 else cache

    def pair(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fp8:
            return k, v
        ks, vs = self.scales
        return (dequantize_kv(k.view(self.cache_dtype), ks, self.dtype),
                dequantize_kv(v.view(self.cache_dtype), vs, self.dtype))

    def fresh(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self.scales
        return round_trip_kv(k, ks, self.cache_dtype), round_trip_kv(v, vs, self.cache_dtype)


def attend_decode_batch(q, k_cache, v_cache, decode: DecodeBatch, scale, window, read: "KVReader",
                        softcap: float | None = None):
    """Attention of a `DecodeBatch`'s queries q [S, Q, H, D] over their cached K/V."""
    lens, max_len = decode.seq_lens, decode.max_seq_len
    num_seqs, n_blocks = decode.block_tables.shape
    ids = decode.block_tables.flatten()
    shape = (num_seqs, n_blocks * k_cache.shape[1], *k_cache.shape[2:])
    # index_select copies whole pages; plain indexing here is several times slower
    keys = read.raw(k_cache).index_select(0, ids).view(shape)[:, :max_len]  # [B, L, KVH, D]
    vals = read.raw(v_cache).index_select(0, ids).view(shape)[:, :max_len]
    keys, vals = read.pair(keys, vals)
    # Query j of a sequence with n queries sits at position len - n + j (a padded j
    # is masked as the last real one: its output is dropped).
    num_q = decode.max_query_len
    j = torch.arange(num_q, device=q.device)[None, :]
    q_pos = lens[:, None] - decode.query_lens[:, None] + torch.minimum(j, decode.query_lens[:, None] - 1)
    pos = torch.arange(max_len, device=q.device)
    mask = pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]
    if window is not None:
        mask &= pos[None, None, :] > (q_pos[:, :, None] - window)
    # The H/KVH query heads sharing a KV head, for every query of the sequence, attend
    # as that head's "query positions": one flash call, no copies of K/V per head.
    _, _, num_heads, head_dim = q.shape
    num_kv = keys.shape[2]
    group = num_heads // num_kv
    qg = q.view(num_seqs, num_q, num_kv, group, head_dim).transpose(1, 2).reshape(num_seqs, num_kv, -1, head_dim)
    mask = mask.repeat_interleave(group, dim=1)[:, None]
    o = masked_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), mask, scale, softcap)
    o = o.view(num_seqs, num_kv, num_q, group, head_dim).transpose(1, 2)
    return o.reshape(num_seqs, num_q, num_heads, head_dim)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """A sequence's first `seq_len` cached K and V, each [seq_len, KVH, D]."""
    n = -(-seq_len // k_cache.shape[1])
    ids = block_table[:n]
    return k_cache.index_select(0, ids).flatten(0, 1)[:seq_len], v_cache.index_select(0, ids).flatten(0, 1)[:seq_len]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float | None) -> torch.Tensor:
    """Masked attention [B, H, Q, D] over k/v [B, H, L, D] (mask True = attend); with
    `softcap`, transformers' eager op order: (q @ k^T) * scale, tanh(s / cap) * cap,
    mask, softmax in float32, cast, @ v."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
            softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last len(q) positions of a context of len(k) tokens."""
    q_len, kv_len = q.shape[0], k.shape[0]
    # A leading batch dim puts SDPA on its flash kernel (2-3x faster than 3-D input).
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if softcap is not None:
        group = q.shape[1] // k.shape[1]
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        o = masked_attention(qt, kt, vt, _causal_mask(q_len, kv_len, window, q.device), scale, softcap)
        return o.squeeze(0).transpose(0, 1)
    if q_len == kv_len and window is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = _causal_mask(q_len, kv_len, window, q.device)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _causal_mask(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len], True where query i (position kv_len - q_len + i) sees key j."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask

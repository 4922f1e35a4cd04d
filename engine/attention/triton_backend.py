"""Triton backend: paged kernels for decode and for prefill over paged KV."""

from __future__ import annotations

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata, write_kv


class TritonAttention(AttentionBackend):
    name = "triton"

    def forward(self, q, k, v, kv, meta: AttentionMetadata, scale: float, sliding_window: int | None):
        from pdserve.engine.attention import triton_kernels as kernels

        write_kv(k, v, kv, meta)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        if meta.max_query_len == 1:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window
            )
        return kernels.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, scale, sliding_window,
        )

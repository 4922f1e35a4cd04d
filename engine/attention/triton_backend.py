"""Triton backend: paged kernels for decode and for prefill over paged KV (with
attention logit soft-capping for Gemma 2)."""

from __future__ import annotations

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata, write_kv


class TritonAttention(AttentionBackend):
    name = "triton"

    def forward(self, q, k, v, kv, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                kv_scales: tuple[float, float] = (1.0, 1.0), softcap: float | None = None):
        from pdserve.engine.attention import triton_kernels as kernels

        write_kv(k, v, kv, meta.kv_rows, meta.block_size, kv_scales)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        # A float8 cache is read by the kernels as value * scale (K/V of a fresh prompt
        # too: they are attended from the cache, as written), like the torch reference.
        k_scale, v_scale = kv_scales
        if meta.max_query_len == 1:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,
                k_scale=k_scale, v_scale=v_scale, softcap=softcap,
            )
        return kernels.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, scale, sliding_window, k_scale=k_scale, v_scale=v_scale, softcap=softcap,
        )

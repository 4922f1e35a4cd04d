"""Triton kernels for attention over a paged KV cache.

Cache layout
------------
The engine keeps the whole KV cache in one tensor of shape
``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` and hands the
kernels the per-layer views ``kv[l, :, 0]`` (keys) and ``kv[l, :, 1]`` (values),
each of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.  Those views
are *not* contiguous (the block stride skips over the other half of the K/V
pair), so every address is built from the tensors' own ``.stride()`` values and
never from the shape.

Index arithmetic
----------------
Token ``p`` (0-based position in its sequence) of sequence ``b`` lives at

    page = block_tables[b, p // block_size]          # physical block id
    slot = p % block_size                            # row inside that block
    &K[p, kvh, d] = k_ptr + page * stride_blk + slot * stride_slot
                          + kvh * stride_head + d * stride_dim

``block_size`` is a compile-time power of two, so ``//`` and ``%`` become a
shift and a mask.  The physical block id is widened to int64 before it is
multiplied by the block stride: ``num_blocks * stride_blk`` easily exceeds
2**31 elements for a large cache.  Both kernels walk the KV sequence in tiles of
``BLOCK_N`` consecutive *logical* positions; a tile may cover several pages (or
part of one), because the page of each position is looked up individually.
Block-table entries (and the K/V rows they point to) are only loaded for
positions that are inside the sequence, so padding entries of ``block_tables``
and stale rows after ``seq_len`` are never read.

GQA: query head ``h`` reads KV head ``h // (H // KVH)``.  Both kernels assign
one KV head per program and put the ``H // KVH`` query heads that share it into
the rows of the same tile, so each K/V tile is loaded once per group.

Masking: the query at position ``p`` sees cache positions ``j`` with
``j <= p`` and, with a sliding window ``W``, ``j >= p - W + 1`` (Hugging Face
Mistral semantics: the window includes the query token itself).

Softmax is computed online (flash-attention style) in float32 with base-2
exponentials; scores are pre-multiplied by ``scale * log2(e)``. With a soft-cap
``c`` (Gemma 2's attn_logit_softcapping) a score ``s`` becomes
``c * tanh(s * scale / c)`` before the mask, computed in the same log2 units as
``(c log2 e) * tanh(x / (c log2 e))`` with ``x = s * scale * log2 e``.

FP8 cache (``--kv-cache-dtype fp8*``): the pages hold K / k_scale and V / v_scale
as float8_e4m3fn or float8_e5m2 (written by ``attention.base.write_kv``). The
kernels load the float8 values, widen them to float32, multiply by the layer's
scale and round to the query's dtype, exactly as the torch reference's
``dequantize_kv`` does, so both backends attend to the same K/V.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["paged_decode_attention", "paged_prefill_attention"]

_LOG2E = 1.4426950408889634
_FP8_CACHE = (torch.float8_e4m3fn, torch.float8_e5m2)
# Finite "minus infinity" for the running max: a row whose first tiles are
# fully masked keeps m = _NEG_BIG, so exp2(m_old - m_new) stays finite (exp2 of
# -inf - -inf would be NaN), while masked scores (-inf) still give p = 0.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, IEEE_F32: tl.constexpr):
    """a @ b; float32 tiles in IEEE precision (TF32 would drift from the reference)."""
    if IEEE_F32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _load_rows(ptr, page, slot, kvh, offs_d, stride_b, stride_s, stride_h, stride_d, mask):
    """K (or V) of one tile's positions, [BLOCK_N, D_PAD]: position i is `slot[i]` of
    physical block `page[i]` (the index arithmetic in the module docstring)."""
    off = page[:, None] * stride_b + slot[:, None] * stride_s + kvh * stride_h + offs_d[None, :] * stride_d
    return tl.load(ptr + off, mask=mask, other=0.0)


@triton.jit
def _dequantized(x, scale, like):
    """A float8 tile read back as `like`'s dtype: float32(x) * scale, then rounded."""
    return (x.to(tl.float32) * scale).to(like.dtype)


@triton.jit
def _log2_scores(s, scale_log2e, softcap_log2e, SOFTCAP: tl.constexpr):
    """Raw scores -> softmax logits in log2 units, soft-capped when SOFTCAP."""
    x = s * scale_log2e
    if SOFTCAP:
        # tanh(y) = 1 - 2 / (exp(2y) + 1): saturates to +-1 (exp -> inf or 0), no NaN
        x = softcap_log2e * (1.0 - 2.0 / (tl.exp(2.0 * (x / softcap_log2e)) + 1.0))
    return x


@triton.jit
def _fold_tile(s, v, m_i, l_i, acc, IEEE_F32: tl.constexpr):
    """Online softmax: fold one tile's scores `s` (log2-scaled, masked to -inf) and
    values `v` into the running row max `m_i`, row sum `l_i` and output `acc`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_F32)
    return m_new, l_i, acc


@triton.jit
def _normalized(acc, l_i):
    """The output rows: acc / l (a row that saw no position, l = 0, stays 0)."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / l_safe[:, None]


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr,
    scale_log2e,
    window,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    k_scale,
    v_scale,
    softcap_log2e,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    IEEE_F32: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # One program per (sequence, kv head). Rows of the tile are the QPK query
    # heads kvh*QPK .. kvh*QPK+QPK-1 (padded to BLOCK_H >= 16 for tl.dot).
    b = tl.program_id(0)
    kvh = tl.program_id(1)

    seq_len = tl.load(seq_lens_ptr + b)
    q_pos = seq_len - 1  # the query is the last token in the cache

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < QPK
    d_mask = offs_d < HEAD_DIM
    heads = kvh * QPK + offs_h

    q_off = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    lo = 0
    if SLIDING:
        lo = tl.maximum(q_pos - window + 1, 0)
    # Start at the tile containing `lo`, aligned to BLOCK_N so that (for
    # BLOCK_N a multiple of the page size) every tile covers whole pages.
    start = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_H], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], dtype=tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for start_n in range(start, seq_len, BLOCK_N):
        pos = start_n + offs_n
        valid = pos < seq_len
        if SLIDING:
            valid = valid & (pos >= lo)
        page = tl.load(bt_row + (pos // PAGE_SIZE) * stride_btn, mask=valid, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]

        k = _load_rows(k_ptr, page, slot, kvh, offs_d, stride_kb, stride_ks, stride_kh, stride_kd, kv_mask)
        if KV_FP8:
            k = _dequantized(k, k_scale, q)
        s = _dot(q, tl.trans(k), IEEE_F32)
        s = tl.where(valid[None, :], _log2_scores(s, scale_log2e, softcap_log2e, SOFTCAP), float("-inf"))
        v = _load_rows(v_ptr, page, slot, kvh, offs_d, stride_vb, stride_vs, stride_vh, stride_vd, kv_mask)
        if KV_FP8:
            v = _dequantized(v, v_scale, q)
        m_i, l_i, acc = _fold_tile(s, v, m_i, l_i, acc, IEEE_F32)

    out = _normalized(acc, l_i)
    o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    scale_log2e,
    window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    k_scale,
    v_scale,
    softcap_log2e,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    IEEE_F32: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # One program per (query tile, kv head, sequence). The BLOCK_M rows of the
    # tile are BLOCK_Q consecutive queries x the QPK query heads of this kv
    # head: row r -> query m_start + r // QPK, head kvh * QPK + r % QPK
    # (rows r >= BLOCK_Q * QPK are padding when QPK is not a power of two).
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m_start = pid_q * BLOCK_Q
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    # Queries are the last q_len tokens of the context: query j is at
    # position ctx_start + j.
    ctx_start = seq_len - q_len

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    q_local = offs_r // QPK
    q_idx = m_start + q_local
    heads = kvh * QPK + offs_r % QPK
    row_valid = (q_local < BLOCK_Q) & (q_idx < q_len)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_valid[:, None] & d_mask[None, :]

    tok = (q_start + q_idx).to(tl.int64)
    q_off = tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    q_pos = ctx_start + q_idx  # [BLOCK_M]

    # KV range needed by the valid rows of this tile: [lo, hi).
    last_q = tl.minimum(m_start + BLOCK_Q, q_len) - 1
    hi = ctx_start + last_q + 1
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx_start + m_start - window + 1, 0)
    start = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for start_n in range(start, hi, BLOCK_N):
        pos = start_n + offs_n
        kv_valid = pos < hi  # hi <= seq_len: never touches padding pages
        if SLIDING:
            kv_valid = kv_valid & (pos >= lo)
        page = tl.load(bt_row + (pos // PAGE_SIZE) * stride_btn, mask=kv_valid, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = kv_valid[:, None] & d_mask[None, :]

        k = _load_rows(k_ptr, page, slot, kvh, offs_d, stride_kb, stride_ks, stride_kh, stride_kd, kv_mask)
        if KV_FP8:
            k = _dequantized(k, k_scale, q)
        s = _dot(q, tl.trans(k), IEEE_F32)
        # Causal (+ window) mask per (row, column). For valid rows it implies
        # kv_valid; padded rows compute garbage that is never stored.
        mask = pos[None, :] <= q_pos[:, None]
        if SLIDING:
            mask = mask & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(mask, _log2_scores(s, scale_log2e, softcap_log2e, SOFTCAP), float("-inf"))
        v = _load_rows(v_ptr, page, slot, kvh, offs_d, stride_vb, stride_vs, stride_vh, stride_vd, kv_mask)
        if KV_FP8:
            v = _dequantized(v, v_scale, q)
        m_i, l_i, acc = _fold_tile(s, v, m_i, l_i, acc, IEEE_F32)

    out = _normalized(acc, l_i)
    o_off = tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate cache/query shapes; return (block_size, num_kv_heads, queries_per_kv)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, KVH, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if v_cache.dtype != k_cache.dtype or (k_cache.dtype != q.dtype and k_cache.dtype not in _FP8_CACHE):
        raise ValueError(
            f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype} "
            f"(the cache is q's dtype or float8_e4m3fn / float8_e5m2)"
        )
    return block_size, num_kv_heads, num_heads // num_kv_heads


def _kv_scale_args(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> dict:
    """The kernels' FP8 arguments; the scales are only read for a float8 cache."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite float, got {value}")
    return dict(k_scale=float(k_scale), v_scale=float(v_scale), KV_FP8=k_cache.dtype in _FP8_CACHE)


def _softcap_args(softcap: float | None) -> dict:
    """The kernels' soft-cap arguments (the cap in log2 units; unread without SOFTCAP)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: must be > 0, got {softcap}")
    return dict(softcap_log2e=float(softcap or 1.0) * _LOG2E, SOFTCAP=softcap is not None)


def _window_args(sliding_window: int | None) -> tuple[bool, int]:
    if sliding_window is None:
        return False, 0
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    return True, int(sliding_window)


def _pow2_at_least(x: int, minimum: int) -> int:
    return max(minimum, triton.next_power_of_2(x))


def _check_tile(name: str, value: int) -> None:
    # tl.dot needs every dimension >= 16 on NVIDIA GPUs.
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Single-token (decode) attention over a paged KV cache.

    Args:
        q: ``[B, H, D]``, one query token per sequence (any strides).
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``, possibly
            non-contiguous views; addressed through their strides. Either
            ``q``'s dtype or float8 (e4m3fn / e5m2), read as value * scale.
        block_tables: ``[B, max_blocks]`` int32. Position ``p`` of sequence
            ``b`` is at block ``block_tables[b, p // block_size]``, slot
            ``p % block_size``. Entries past the sequence's last used block
            are never read.
        seq_lens: ``[B]`` int32, tokens in the cache per sequence, including
            the query token (position ``seq_len - 1``), whose K/V must
            already be written.
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: if set to ``W``, the query at ``p`` attends to
            positions ``max(0, p - W + 1) .. p``.
        block_n: optional override of the KV tile length (power of two >= 16);
            tuning knob, the default is chosen from the page size.
        k_scale, v_scale: a float8 cache's per-layer scales (ignored otherwise).
        softcap: if set to ``c``, scores become ``c * tanh(score * scale / c)``.

    Returns:
        ``[B, H, D]`` tensor in ``q``'s dtype. Accumulation is float32.

    Grid: one program per (sequence, kv head); the ``H // KVH`` query heads
    sharing the kv head are the rows of one tile (padded to >= 16 rows for
    ``tl.dot``), so each page is read once per group.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got {tuple(q.shape)}")
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads, qpk = _check_cache(q, k_cache, v_cache)
    fp8 = _kv_scale_args(k_cache, k_scale, v_scale)
    sliding, window = _window_args(sliding_window)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    d_pad = _pow2_at_least(head_dim, 16)
    if block_n is None:
        # 64 tokens per tile keeps enough loads in flight; fp32 with a wide
        # head halves it to bound shared memory / registers.
        block_n = 32 if (q.element_size() >= 4 and d_pad > 64) else 64
    _check_tile("block_n", block_n)

    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        float(scale) * _LOG2E,
        window,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        QPK=qpk,
        BLOCK_H=_pow2_at_least(qpk, 16),
        PAGE_SIZE=block_size,
        BLOCK_N=block_n,
        SLIDING=sliding,
        IEEE_F32=q.dtype == torch.float32,
        **fp8,
        **_softcap_args(softcap),
        num_warps=4,
        num_stages=2,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for variable-length query chunks over a paged KV cache.

    Args:
        q: ``[T, H, D]``, the queries of B sequences packed without padding;
            sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b+1]``.
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]`` strided views.
        block_tables: ``[B, max_blocks]`` int32 (see ``paged_decode_attention``).
        seq_lens: ``[B]`` int32, context length per sequence *including* its
            new queries, all of which are already in the cache.
        query_start_loc: ``[B + 1]`` int32 prefix sum of query lengths
            (starts at 0). ``q_len_b`` may be 0.
        max_query_len: ``max_b q_len_b`` (host int; sizes the grid).
        scale: softmax scale.
        sliding_window: optional window ``W`` (query at ``p`` sees
            ``p - W + 1 .. p``).
        block_m: optional rows per tile (power of two >= 16); rows are
            ``block_m // (H // KVH)`` queries x the ``H // KVH`` heads of a
            kv head.
        block_n: optional KV tile length (power of two >= 16).
        k_scale, v_scale: a float8 cache's per-layer scales (ignored otherwise).
        softcap: if set to ``c``, scores become ``c * tanh(score * scale / c)``.

    Query ``j`` of sequence ``b`` is at position
    ``seq_lens[b] - q_len_b + j`` and attends to cache positions ``<= p``
    (and ``>= p - W + 1``), which covers full prefill, prefill after a
    prefix-cache hit, chunked prefill and decode rows (``q_len == 1``) in one
    launch.

    Grid: ``(cdiv(max_query_len, BLOCK_Q), KVH, B)``; a program whose query
    tile starts past its sequence's ``q_len`` exits at once. Each program
    only visits KV tiles between the window start of its first query and
    its last query's position, so fully-masked tiles are skipped.

    Returns:
        ``[T, H, D]`` in ``q``'s dtype.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads, qpk = _check_cache(q, k_cache, v_cache)
    fp8 = _kv_scale_args(k_cache, k_scale, v_scale)
    sliding, window = _window_args(sliding_window)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError("query_start_loc must have B + 1 entries")
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out

    d_pad = _pow2_at_least(head_dim, 16)
    if block_m is None:
        block_m = 64 if (q.element_size() < 4 or d_pad <= 64) else 32
    if block_n is None:
        block_n = 64 if (q.element_size() < 4 or d_pad <= 64) else 32
    _check_tile("block_m", block_m)
    _check_tile("block_n", block_n)
    # At least one query per tile: the GQA group must fit in the rows.
    block_m = max(block_m, _pow2_at_least(qpk, 16))
    block_q = block_m // qpk
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, batch)

    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        float(scale) * _LOG2E,
        window,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        QPK=qpk,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        PAGE_SIZE=block_size,
        BLOCK_N=block_n,
        SLIDING=sliding,
        IEEE_F32=q.dtype == torch.float32,
        **fp8,
        **_softcap_args(softcap),
        num_warps=4 if block_m <= 64 else 8,
        num_stages=2,
    )
    return out

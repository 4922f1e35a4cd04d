"""Paged-attention Triton kernels vs. a naive float64 torch reference.

Without CUDA the kernels run in Triton's interpreter, which has to be enabled
through TRITON_INTERPRET before the kernels are *decorated* (i.e. before
engine.attention.triton_kernels is first imported), so it is set here, at the
top of the module. The interpreter mishandles bfloat16, so CPU runs cover
float32 and float16 only; tests/gpu/check_triton.py covers bf16 on a GPU.
Shapes are kept tiny because the interpreter executes every program in Python.
"""

from __future__ import annotations

import os

import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pdserve.engine.attention import triton_kernels as tk  # noqa: E402

if not _HAS_CUDA:
    from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

    if not isinstance(tk._paged_decode_kernel, InterpretedFunction):
        pytest.skip(
            "no CUDA and the Triton kernels were compiled without the interpreter: "
            "pdserve.engine.attention.triton_kernels was imported before TRITON_INTERPRET=1 was set "
            "(or TRITON_INTERPRET is set to a false value); run with TRITON_INTERPRET=1",
            allow_module_level=True,
        )

    from triton_interpreter import skip_repatching  # noqa: E402

    skip_repatching()

DEVICE = torch.device("cuda" if _HAS_CUDA else "cpu")

# Tolerances, against a float64 reference computed from the *same* (already
# rounded) q/k/v values, so only the kernel's own arithmetic is measured:
# - float32: fp32 accumulation, exp2 with a pre-scaled log2(e) and the online
#   softmax rescaling give errors of a few 1e-7 relative; atol 1e-5 / rtol 1e-4
#   leaves headroom (on GPU the fp32 dots are forced to IEEE, not TF32).
# - float16: P is rounded to fp16 (rel. error 2**-11) before the P@V dot, like
#   every flash-attention kernel, and the output is rounded to fp16 (half an
#   ulp is 2**-11 ~ 4.9e-4 for |out| in [1, 2)); atol/rtol 2e-3 covers both.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}

NUM_LAYERS = 2
LAYER = 1  # use the second layer so the views start at a non-zero offset


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_cache(seq_lens, *, block_size, num_kv_heads, head_dim, dtype, seed, spare_blocks=3):
    """Build a [L, NB, 2, BS, KVH, D] cache, shuffled block tables, and views.

    Every value the kernels must not read is NaN: layer 0, spare blocks,
    slots past seq_len in each sequence's last block, and the blocks that
    padding entries of the block table point to. Reading any of them turns
    the output into NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [_cdiv(n, block_size) for n in seq_lens]
    used = sum(blocks_per_seq)
    num_blocks = used + spare_blocks
    kv = torch.randn(NUM_LAYERS, num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    kv[:LAYER] = float("nan")
    perm = torch.randperm(num_blocks, generator=gen)
    spare = perm[used:]
    kv[:, spare] = float("nan")

    max_blocks = max(blocks_per_seq) + 2  # always some padding columns
    block_tables = spare[torch.randint(0, spare_blocks, (len(seq_lens), max_blocks), generator=gen)]
    offset = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[b, :nb] = perm[offset:offset + nb]
        offset += nb
        if n % block_size:
            kv[:, perm[offset - 1], :, n % block_size:] = float("nan")

    kv = kv.to(dtype=dtype, device=DEVICE)
    k_cache, v_cache = kv[LAYER, :, 0], kv[LAYER, :, 1]
    assert not k_cache.is_contiguous() and not v_cache.is_contiguous()
    return (
        k_cache,
        v_cache,
        block_tables.to(torch.int32).to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def make_queries(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """q as a non-contiguous slice of a fused [T, H + 2*KVH, D] qkv tensor."""
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen) * 1.5
    return qkv.to(dtype=dtype, device=DEVICE)[:, :num_heads]


def reference_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, sliding_window):
    """Naive attention in float64: gather each sequence's context, explicit mask."""
    q, k_cache, v_cache = (t.detach().cpu().double() for t in (q, k_cache, v_cache))
    block_tables = block_tables.cpu().long()
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    start = 0
    for b, (n, qlen) in enumerate(zip(seq_lens.tolist(), query_lens)):
        if qlen == 0:
            continue
        blocks = block_tables[b, : _cdiv(n, block_size)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1])[:n]
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[-1])[:n]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # head h -> kv head h // group
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        qb = q[start:start + qlen]
        q_pos = torch.arange(n - qlen, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos >= q_pos - sliding_window + 1
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:start + qlen] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += qlen
    return out


def assert_close(actual, expected, dtype):
    assert not torch.isnan(actual).any(), "kernel output has NaNs (read masked/padding data?)"
    torch.testing.assert_close(actual.cpu().double(), expected, **TOLERANCES[dtype])


DTYPES = [torch.float32, torch.float16]
HEADS = [(4, 2), (2, 2)]  # (H, KVH): GQA and MHA
HEAD_DIMS = [16, 80]  # 80: non-power-of-two head dim, padded to 128
BLOCK_SIZES = [8, 16]
WINDOWS = [None, 7]


def _seed(*parts) -> int:
    # Deterministic across runs (str hashes are salted per process).
    return zlib.crc32(repr(parts).encode()) % 10_000


def _id(v):
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return None


# (seq_len, q_len): plain prefill, prefix-cache hit (block-aligned prefix),
# chunked prefill (unaligned middle chunk), decode rows, an idle sequence,
# and a one-token sequence.
PREFILL_MIX = [(19, 19), (37, 13), (30, 10), (23, 1), (9, 0), (1, 1), (45, 1)]
DECODE_LENS = [1, 7, 16, 33, 50, 24]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}KV{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_prefill_matches_reference(dtype, heads, head_dim, block_size, window):
    num_heads, num_kv_heads = heads
    seq_lens = [n for n, _ in PREFILL_MIX]
    query_lens = [ql for _, ql in PREFILL_MIX]
    seed = _seed(dtype, heads, head_dim, block_size, window)
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_cache(
        seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed
    )
    q = make_queries(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, seed)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = reference_attention(q, k_cache, v_cache, block_tables, seq_lens_t, query_lens, scale, window)

    # Small tiles: several query tiles per sequence, several pages per KV tile
    # (block_size 8) or exactly one (16), window-skipped leading tiles.
    out = tk.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens_t, qsl, max(query_lens), scale, window,
        block_m=16, block_n=16,
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}KV{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_decode_matches_reference(dtype, heads, head_dim, block_size, window):
    num_heads, num_kv_heads = heads
    seed = _seed(dtype, heads, head_dim, block_size, window, "decode")
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_cache(
        DECODE_LENS, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed
    )
    q = make_queries(len(DECODE_LENS), num_heads, num_kv_heads, head_dim, dtype, seed)
    scale = head_dim**-0.5
    expected = reference_attention(
        q, k_cache, v_cache, block_tables, seq_lens_t, [1] * len(DECODE_LENS), scale, window
    )
    out = tk.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale, window, block_n=16)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("window", [None, 1, 5, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_default_tiles_and_window_edges(dtype, window):
    """Default tile sizes (one query tile, KV tiles spanning many pages) and
    window edge cases: 1 (self only), 5, larger than every sequence."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 1, 16, 8
    mix = [(70, 70), (41, 9), (12, 1)]
    seq_lens = [n for n, _ in mix]
    query_lens = [ql for _, ql in mix]
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_cache(
        seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=7
    )
    q = make_queries(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, seed=7)
    qsl = torch.tensor([0, 70, 79, 80], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = reference_attention(q, k_cache, v_cache, block_tables, seq_lens_t, query_lens, scale, window)
    out = tk.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens_t, qsl, 70, scale, window)
    assert_close(out, expected, dtype)

    # The last query of each sequence through the decode kernel must agree.
    last = qsl[1:].long() - 1
    dec = tk.paged_decode_attention(q[last], k_cache, v_cache, block_tables, seq_lens_t, scale, window)
    assert_close(dec, expected[last.cpu()], dtype)


def test_empty_inputs():
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_cache(
        [5, 3], block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=3
    )
    q = torch.zeros(0, 4, 16, device=DEVICE)
    qsl = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    out = tk.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens_t, qsl, 0, 0.25)
    assert out.shape == (0, 4, 16)


def test_rejects_bad_arguments():
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_cache(
        [5], block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=4
    )
    q = torch.zeros(1, 3, 16, device=DEVICE)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple"):
        tk.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25)
    q = torch.zeros(1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sliding_window"):
        tk.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="block_n"):
        tk.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25, block_n=8)
    assert math.isfinite(
        tk.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25).abs().sum().item()
    )


# --- FP8 KV cache (--kv-cache-dtype fp8*): pages hold K / k_scale and V / v_scale ---

from pdserve.engine.attention.base import dequantize_kv, quantize_kv  # noqa: E402
from pdserve.engine.model_runner import attention_metadata  # noqa: E402

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def to_fp8_cache(k_cache, v_cache, cache_dtype, k_scale, v_scale):
    """Quantize a paged cache's K and V pages into one [NB, 2, BS, KVH, D] float8
    tensor (as write_kv stores them); returns its strided K and V views. NaN stays NaN,
    so reading a slot the kernels must not read still shows."""
    kv = torch.empty((k_cache.shape[0], 2, *k_cache.shape[1:]), dtype=cache_dtype, device=k_cache.device)
    kv[:, 0] = quantize_kv(k_cache, k_scale, cache_dtype)
    kv[:, 1] = quantize_kv(v_cache, v_scale, cache_dtype)
    return kv[:, 0], kv[:, 1]


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_fp8_cache_matches_dequantized_reference(dtype, cache_dtype):
    """Decode and prefill-over-pages on float8 pages (GQA, non-unit scales, a window on
    the decode side) attend to exactly value * scale in q's dtype."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    k_scale, v_scale = 0.37, 2.5
    seed = _seed(dtype, cache_dtype, "fp8")
    seq_lens = [n for n, _ in PREFILL_MIX]
    query_lens = [ql for _, ql in PREFILL_MIX]
    k_hi, v_hi, block_tables, seq_lens_t = make_paged_cache(
        seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32, seed=seed
    )
    k8, v8 = to_fp8_cache(k_hi * 3, v_hi * 3, cache_dtype, k_scale, v_scale)
    assert k8.dtype == cache_dtype and not k8.is_contiguous()
    k_ref, v_ref = dequantize_kv(k8, k_scale, dtype), dequantize_kv(v8, v_scale, dtype)
    q = make_queries(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, seed)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    expected = reference_attention(q, k_ref, v_ref, block_tables, seq_lens_t, query_lens, scale, None)
    out = tk.paged_prefill_attention(
        q, k8, v8, block_tables, seq_lens_t, qsl, max(query_lens), scale, block_m=16, block_n=16,
        k_scale=k_scale, v_scale=v_scale,
    )
    assert out.dtype == dtype
    assert_close(out, expected, dtype)

    last = (qsl[1:].long() - 1).clamp(min=0)
    dq = q[last]
    expected = reference_attention(dq, k_ref, v_ref, block_tables, seq_lens_t, [1] * len(seq_lens), scale, 7)
    out = tk.paged_decode_attention(dq, k8, v8, block_tables, seq_lens_t, scale, 7, block_n=16,
                                    k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, dtype)


def test_fp8_cache_rejects_bad_scales_and_dtypes():
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_cache(
        [5], block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=5
    )
    k8, v8 = to_fp8_cache(k_cache, v_cache, torch.float8_e4m3fn, 1.0, 1.0)
    q = torch.zeros(1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        tk.paged_decode_attention(q, k8, v8, block_tables, seq_lens_t, 0.25, k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale"):
        tk.paged_decode_attention(q, k8, v8, block_tables, seq_lens_t, 0.25, v_scale=float("nan"))
    with pytest.raises(ValueError, match="dtype mismatch"):
        tk.paged_decode_attention(q, k8, v8.view(torch.float8_e5m2), block_tables, seq_lens_t, 0.25)
    with pytest.raises(ValueError, match="dtype mismatch"):
        tk.paged_decode_attention(q.half(), k_cache, v_cache, block_tables, seq_lens_t, 0.25)


def _metadata(q_lens, seq_lens, tables, block_size):
    """AttentionMetadata for one step: sequence b's new tokens are its last q_lens[b]."""
    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, (ql, n) in enumerate(zip(q_lens, seq_lens)) for p in range(n - ql, n)]
    return attention_metadata(tables, slots, list(q_lens), list(seq_lens), block_size, torch.device(DEVICE))


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_fp8_backend_matches_torch_reference(dtype, cache_dtype):
    """TritonAttention vs TorchAttention on a float8 cache through three steps: fresh
    prompts (the torch side attends to the round-tripped K/V, Triton reads the pages),
    a mix of a chunk and decodes, then decodes alone. The caches stay byte-identical."""
    from pdserve.engine.attention.torch_ref import TorchAttention
    from pdserve.engine.attention.triton_backend import TritonAttention

    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    kv_scales = (0.5, 1.75)
    tables = [[5, 2, 7], [0, 3, 6, 1], [4]]
    steps = [([13, 20, 5], [13, 20, 5]), ([1, 6, 1], [14, 26, 6]), ([1, 1, 1], [15, 27, 7])]
    shape = (8, 2, block_size, num_kv_heads, head_dim)
    caches = {name: torch.zeros(shape, dtype=cache_dtype, device=DEVICE) for name in ("torch", "triton")}
    backends = {"torch": TorchAttention(), "triton": TritonAttention()}
    gen = torch.Generator().manual_seed(_seed(dtype, cache_dtype, "backend"))
    for q_lens, seq_lens in steps:
        meta = _metadata(q_lens, seq_lens, tables, block_size)
        t = sum(q_lens)
        q, k, v = (torch.randn(t, h, head_dim, generator=gen).to(dtype=dtype, device=DEVICE) * 2
                   for h in (num_heads, num_kv_heads, num_kv_heads))
        outs = {name: backends[name].forward(q, k, v, caches[name], meta, head_dim**-0.5, None, kv_scales)
                for name in backends}
        assert torch.equal(caches["torch"].view(torch.uint8), caches["triton"].view(torch.uint8))
        assert not torch.isnan(outs["triton"]).any()
        torch.testing.assert_close(outs["triton"], outs["torch"], **TOLERANCES[dtype])

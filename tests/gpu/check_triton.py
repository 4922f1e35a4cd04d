#!/usr/bin/env python
"""GPU check of the paged-attention Triton kernels: correctness + timing.

Runs engine.attention.triton_kernels on CUDA at realistic shapes, compares the
outputs with a naive float64 torch reference and times the kernels against the
naive torch implementation (per-sequence gather from the block table + matmul
+ softmax in the input dtype) with CUDA events after a warm-up.

Cases (all over a [L, NB, 2, BS, KVH, D] cache passed as strided per-layer
views, shuffled block tables, NaN in every slot the kernels must not read):
  decode   paged_decode_attention, --num-seqs sequences of ~--context tokens
  prefill  paged_prefill_attention, --prefill-seqs full prefills of --context
  mixed    paged_prefill_attention with chunked prefill, prefix-cache hits and
           decode rows in one launch (--num-seqs sequences in total)

Example:
  python tests/gpu/check_triton.py                       # defaults below
  python tests/gpu/check_triton.py --dtypes bf16 --window 4096 --cases decode

Exit status: 0 if every comparison is within tolerance, 1 otherwise, 2 if no
CUDA device is present.

``--device cpu`` (with TRITON_INTERPRET=1 set in the environment, tiny shapes,
no bf16) runs the same code path in Triton's interpreter; it only exists to
smoke-test this script without a GPU, its timings are meaningless.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Against a float64 reference computed from the same rounded inputs. fp32 dots
# run as IEEE (not TF32) in the kernels. fp16/bf16: P is rounded to the input
# dtype before P@V and the output is rounded too (half ulp at |x|~2: fp16
# 9.8e-4, bf16 7.8e-3).
TOLERANCES = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=["decode", "prefill", "mixed"], default=["decode", "prefill", "mixed"])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16", "fp32"])
    p.add_argument("--num-seqs", type=int, default=64, help="sequences in the decode and mixed cases")
    p.add_argument("--prefill-seqs", type=int, default=8, help="sequences in the full-prefill case")
    p.add_argument("--context", type=int, default=2048, help="context length per sequence")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=2, help="layers in the cache tensor (views use the last)")
    p.add_argument("--window", type=int, nargs="+", default=[0, 1024], help="sliding windows to test; 0 = none")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--block-m", type=int, default=None, help="override prefill BLOCK_M")
    p.add_argument("--block-n", type=int, default=None, help="override BLOCK_N")
    p.add_argument("--skip-naive-timing", action="store_true", help="only time the Triton kernels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu = smoke test in the Triton interpreter (needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if args.block_size <= 0 or args.block_size & (args.block_size - 1):
        p.error("--block-size must be a power of two")
    return args


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: list[int]
    query_start_loc: torch.Tensor


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_batch(seq_lens: list[int], query_lens: list[int], args, dtype, gen) -> Batch:
    bs, kvh, d, h = args.block_size, args.kv_heads, args.head_dim, args.heads
    nblk = [_cdiv(n, bs) for n in seq_lens]
    used, spare_n = sum(nblk), 4
    num_blocks = used + spare_n
    dev = args.device
    kv = torch.empty(args.num_layers, num_blocks, 2, bs, kvh, d, device=dev, dtype=dtype)
    kv.normal_(generator=gen)
    kv[:-1] = float("nan")
    perm = torch.randperm(num_blocks, device=dev, generator=gen)
    spare = perm[used:]
    kv[:, spare] = float("nan")
    bt = spare[torch.randint(0, spare_n, (len(seq_lens), max(nblk) + 2), device=dev, generator=gen)]
    off = 0
    for b, (n, nb) in enumerate(zip(seq_lens, nblk)):
        bt[b, :nb] = perm[off:off + nb]
        off += nb
        if n % bs:
            kv[:, perm[off - 1], :, n % bs:] = float("nan")
    qkv = torch.randn(sum(query_lens), h + 2 * kvh, d, device=dev, dtype=dtype, generator=gen)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    return Batch(
        q=qkv[:, :h],
        k_cache=kv[-1, :, 0],
        v_cache=kv[-1, :, 1],
        block_tables=bt.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_lens=list(query_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
    )


def naive_attention(batch: Batch, scale: float, window: int | None, compute_dtype=None) -> torch.Tensor:
    """Per-sequence gather + explicit mask + softmax (fp32 softmax unless fp64)."""
    q, kc, vc = batch.q, batch.k_cache, batch.v_cache
    if compute_dtype is not None:
        q, kc, vc = q.to(compute_dtype), kc.to(compute_dtype), vc.to(compute_dtype)
    h, kvh, bs = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.empty_like(q)
    seq_lens = batch.seq_lens.tolist()
    start = 0
    for b, (n, ql) in enumerate(zip(seq_lens, batch.query_lens)):
        if ql == 0:
            continue
        blocks = batch.block_tables[b, : _cdiv(n, bs)].long()
        k = kc[blocks].reshape(-1, kvh, kc.shape[-1])[:n].repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        v = vc[blocks].reshape(-1, kvh, vc.shape[-1])[:n].repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        qb = q[start:start + ql].transpose(0, 1)  # [H, ql, D]
        s = torch.matmul(qb, k.transpose(1, 2))
        s = (s if s.dtype == torch.float64 else s.float()) * scale
        qpos = torch.arange(n - ql, n, device=q.device)[:, None]
        kpos = torch.arange(n, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        s = s.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
        out[start:start + ql] = torch.matmul(s, v).transpose(0, 1)
        start += ql
    return out


def time_ms(fn, warmup: int, iters: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def attended_pairs(seq_lens: list[int], query_lens: list[int], window: int | None) -> int:
    total = 0
    for n, ql in zip(seq_lens, query_lens):
        for p in range(n - ql, n):
            total += min(p + 1, window) if window else p + 1
    return total


def make_case(name: str, args, gen) -> tuple[list[int], list[int]]:
    c = args.context
    lens = torch.randint(max(1, c * 3 // 4), c + c // 4 + 1, (max(args.num_seqs, args.prefill_seqs),), generator=gen).tolist()
    if name == "decode":
        seq = lens[: args.num_seqs]
        return seq, [1] * len(seq)
    if name == "prefill":
        seq = [c] * args.prefill_seqs
        return seq, list(seq)
    # mixed: 1/16 chunked-prefill chunks, 1/16 prefix-cache hits, rest decode.
    seq, ql = [], []
    n_chunk = max(1, args.num_seqs // 16)
    n_prefix = max(1, args.num_seqs // 16)
    for i, n in enumerate(lens[: args.num_seqs]):
        if i < n_chunk:  # chunk of 512 in the middle of a prompt
            seq.append(n)
            ql.append(min(512, n))
        elif i < n_chunk + n_prefix:  # prefix hit: first half cached
            seq.append(n)
            ql.append(n - (n // 2 // args.block_size) * args.block_size)
        else:
            seq.append(n)
            ql.append(1)
    return seq, ql


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check_triton: no CUDA device available; this script only runs on a GPU machine.", file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check_triton: --device cpu needs TRITON_INTERPRET=1 in the environment.", file=sys.stderr)
        return 2

    from pdserve.engine.attention.triton_kernels import paged_decode_attention, paged_prefill_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}  torch {torch.__version__}")
    print(
        f"H={args.heads} KVH={args.kv_heads} D={args.head_dim} block_size={args.block_size} "
        f"context~{args.context} num_seqs={args.num_seqs} prefill_seqs={args.prefill_seqs}"
    )
    header = (
        f"{'case':8} {'dtype':5} {'window':>6} {'tokens':>7} {'triton ms':>10} {'naive ms':>10} "
        f"{'speedup':>8} {'max err':>9} {'tol':>8} {'ok':>3}  throughput"
    )
    print(header)
    print("-" * len(header))
    scale = args.head_dim ** -0.5
    all_ok = True
    for case in args.cases:
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            for w in args.window:
                window = w or None
                gen = torch.Generator(device=args.device).manual_seed(args.seed)
                cpu_gen = torch.Generator().manual_seed(args.seed)
                seq_lens, query_lens = make_case(case, args, cpu_gen)
                batch = build_batch(seq_lens, query_lens, args, dtype, gen)

                if case == "decode":
                    def run():
                        return paged_decode_attention(
                            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                            scale, window, block_n=args.block_n,
                        )
                else:
                    max_ql = max(query_lens)

                    def run():
                        return paged_prefill_attention(
                            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                            batch.query_start_loc, max_ql, scale, window,
                            block_m=args.block_m, block_n=args.block_n,
                        )

                out = run()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                ref = naive_attention(batch, scale, window, compute_dtype=torch.float64)
                err = (out.double() - ref).abs()
                atol, rtol = TOLERANCES[dtype]
                ok = bool(torch.isfinite(out).all()) and bool((err <= atol + rtol * ref.abs()).all())
                all_ok &= ok
                max_err = err.max().item() if err.numel() else 0.0
                del ref, err

                t_triton = time_ms(run, args.warmup, args.iters, args.device)
                if args.skip_naive_timing:
                    t_naive = float("nan")
                else:
                    t_naive = time_ms(lambda: naive_attention(batch, scale, window), max(1, args.warmup // 2),
                                      max(1, args.iters // 4), args.device)

                elem = batch.q.element_size()
                if case == "decode":
                    kv_tokens = sum(min(n, window) if window else n for n in seq_lens)
                    nbytes = kv_tokens * args.kv_heads * args.head_dim * 2 * elem + 2 * batch.q.numel() * elem
                    thr = f"{nbytes / t_triton / 1e6:8.1f} GB/s (K/V read)"
                else:
                    flops = 4 * args.heads * args.head_dim * attended_pairs(seq_lens, query_lens, window)
                    thr = f"{flops / t_triton / 1e9:8.1f} TFLOP/s (useful)"
                print(
                    f"{case:8} {dname:5} {str(window or '-'):>6} {sum(query_lens):>7} {t_triton:10.3f} "
                    f"{t_naive:10.3f} {t_naive / t_triton:8.1f} {max_err:9.2e} {atol:8.0e} {'yes' if ok else 'NO':>3}  {thr}"
                )
                del batch, out
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    print("all within tolerance" if all_ok else "SOME COMPARISONS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

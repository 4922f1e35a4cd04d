#!/usr/bin/env python
"""GPU check of the quantization kernels (issue 20): correctness + timing.

  gemm   int8_linear (per channel, and per group of 128: compressed-tensors' W8A16),
         int4_linear (group 128), fp4_linear (NVFP4), fp8_linear (W8A8,
         per-token and static activation scales) at M in --m (decode 1, 16; a prefill
         chunk 128), N = --n, K = --k, in bf16 and fp16: each against its
         dequantize-then-matmul reference (engine/quant/formats.py, float32, TF32
         off), timed against torch's bf16 matmul of the same shape (median of --iters
         runs), with the weight bandwidth the kernel reached.
  kv     the Triton attention backend on a float8 cache (e4m3 and e5m2, non-unit
         scales, GQA) against the torch reference backend: fresh prompts, then a
         decode step; outputs within tolerance and the caches byte-identical. The
         decode step is timed against the torch backend's.

One line per check, then `gpu_check_quant ok` (exit 0) or the failures (exit 1).
Exit 2 when there is no CUDA device.

  python tests/gpu/check_quant.py                       # defaults below
  python tests/gpu/check_quant.py --m 1 --dtypes bf16 --skip-kv

``--device cpu`` (with TRITON_INTERPRET=1, tiny shapes, no bf16) runs the same code
in Triton's interpreter; it only smoke-tests the script, its timings are meaningless.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SCHEMES = ("int8", "int8-g128", "int4", "fp4", "fp8", "fp8-static")
KV_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Max error relative to the reference's largest |y|: the kernels differ from the
# float32 reference by summation order, one rounding of the output (bf16 2**-9,
# fp16 2**-12 relative, half an ulp) and, for int4 and grouped int8, one rounding of
# each dequantized weight to x's dtype.
GEMM_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}
# Attention outputs (|o| <~ 3) against the torch backend reading the same float8 values.
KV_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
INT4_GROUP = 128
INT8_GROUP = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 16, 128], help="rows of x (tokens)")
    p.add_argument("--n", type=int, default=4096, help="output features")
    p.add_argument("--k", type=int, default=4096, help="input features (a multiple of 128)")
    p.add_argument("--skip-kv", action="store_true", help="skip the FP8 KV-cache attention checks")
    p.add_argument("--kv-seqs", type=int, default=16, help="sequences in the KV check")
    p.add_argument("--context", type=int, default=1024, help="prompt length in the KV check")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu = smoke test in the Triton interpreter (needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.k % INT4_GROUP:
        p.error(f"--k must be a multiple of {INT4_GROUP}")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return args


def time_ms(fn: Callable[[], object], warmup: int, iters: int, device: str) -> float:
    """Median milliseconds of `iters` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclass
class QuantWeight:
    """One layer's weight in a scheme: the kernel call, the reference, the bytes it stores."""

    run: Callable[[torch.Tensor], torch.Tensor]
    reference: Callable[[torch.Tensor], torch.Tensor]
    nbytes: int


def make_weight(scheme: str, n: int, k: int, device: str, gen: torch.Generator) -> QuantWeight:
    """Random codes and scales of the scheme's layout (values a real checkpoint could hold)."""
    from pdserve.engine.quant import formats as ref
    from pdserve.engine.quant import triton_gemm as tg

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    bias = torch.randn(n, generator=gen, device=device) * 0.1
    if scheme == "int8":
        w = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
        scale = rand(n) * 0.004 + 0.001
        dq = ref.dequantize_int8(w, scale)
        return QuantWeight(lambda x: tg.int8_linear(x, w, scale, bias.to(x.dtype)),
                           lambda x: ref.linear_reference(x, dq, bias.to(x.dtype)), w.numel() + scale.numel() * 4)
    if scheme == "int8-g128":
        w = torch.randint(-128, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
        scale = rand(n, k // INT8_GROUP) * 0.004 + 0.001
        dq = ref.dequantize_int8(w, scale, INT8_GROUP)
        return QuantWeight(lambda x: tg.int8_linear(x, w, scale, bias.to(x.dtype), group_size=INT8_GROUP),
                           lambda x: ref.linear_reference(x, dq, bias.to(x.dtype)), w.numel() + scale.numel() * 4)
    if scheme == "int4":
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.uint8)
        scale = rand(n, k // INT4_GROUP) * 0.02 + 0.005
        zero = torch.randint(0, 16, (n, k // INT4_GROUP), generator=gen, device=device).float()
        dq = ref.dequantize_int4(packed, scale, zero, INT4_GROUP)
        return QuantWeight(lambda x: tg.int4_linear(x, packed, scale, zero, INT4_GROUP),
                           lambda x: ref.linear_reference(x, dq), packed.numel() + scale.numel() * 8)
    if scheme == "fp4":
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.uint8)
        block_scale = (rand(n, k // 16) * 4 + 0.05).to(torch.float8_e4m3fn)
        global_scale = rand(n) * 200 + 100
        dq = ref.dequantize_fp4(packed, block_scale, global_scale)
        return QuantWeight(lambda x: tg.fp4_linear(x, packed, block_scale, global_scale),
                           lambda x: ref.linear_reference(x, dq), packed.numel() + block_scale.numel() + n * 4)
    if scheme in ("fp8", "fp8-static"):
        w = (torch.randn(n, k, generator=gen, device=device) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        w_scale = rand(n) * 2e-4 + 5e-5
        in_scale = torch.tensor(4.0 / 448, device=device) if scheme == "fp8-static" else None
        return QuantWeight(lambda x: tg.fp8_linear(x, w, w_scale, in_scale, bias.to(x.dtype)),
                           lambda x: ref.fp8_linear_reference(x, w, w_scale, in_scale, bias.to(x.dtype)),
                           w.numel() + n * 4)
    raise ValueError(f"unknown scheme {scheme!r}")


def check_gemm(scheme: str, m: int, dtype: torch.dtype, args) -> tuple[bool, str]:
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    weight = make_weight(scheme, args.n, args.k, args.device, gen)
    x = torch.randn(m, args.k, generator=gen, device=args.device).to(dtype)
    y = weight.run(x)
    expected = weight.reference(x).float()
    err = (y.float() - expected).abs().max().item()
    rel = err / max(expected.abs().max().item(), 1e-6)
    ok = bool(torch.isfinite(y).all()) and y.dtype == dtype and rel <= GEMM_TOL[dtype]
    t_kernel = time_ms(lambda: weight.run(x), args.warmup, args.iters, args.device)
    w_bf16 = torch.randn(args.n, args.k, generator=gen, device=args.device).to(torch.bfloat16)
    x_bf16 = x.to(torch.bfloat16)
    t_torch = time_ms(lambda: torch.nn.functional.linear(x_bf16, w_bf16), args.warmup, args.iters, args.device)
    gbps = weight.nbytes / t_kernel / 1e6
    name = f"gemm {scheme:10} {_dname(dtype)} M={m:<4} N={args.n} K={args.k}"
    return ok, (f"{name} max_err={err:.2e} rel={rel:.2e} tol={GEMM_TOL[dtype]:.0e} "
                f"kernel={t_kernel:.4f}ms torch_bf16={t_torch:.4f}ms speedup={t_torch / t_kernel:.2f}x "
                f"weights={gbps:.0f}GB/s {'PASS' if ok else 'FAIL'}")


def _dname(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _metadata(q_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int, device: str):
    """One step's AttentionMetadata: sequence b's new tokens are its last q_lens[b]."""
    from pdserve.engine.attention.base import AttentionMetadata, kv_rows

    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, (ql, n) in enumerate(zip(q_lens, seq_lens)) for p in range(n - ql, n)]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=slot_mapping, kv_rows=kv_rows(slot_mapping, block_size),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size,
        query_lens_cpu=tuple(q_lens), seq_lens_cpu=tuple(seq_lens), query_start_loc_cpu=tuple(qsl),
    )


def check_kv(cache_name: str, dtype: torch.dtype, args) -> tuple[bool, str]:
    """Triton vs torch backend on a float8 cache: prompts (seq b has context - b tokens,
    the last one a prefix-cache hit after half its blocks), then one decode step."""
    from pdserve.engine.attention.torch_ref import TorchAttention
    from pdserve.engine.attention.triton_backend import TritonAttention

    cache_dtype, bs, dev = KV_DTYPES[cache_name], args.block_size, args.device
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    lens = [max(2, args.context - b) for b in range(args.kv_seqs)]
    per_seq = -(-(max(lens) + 1) // bs)
    blocks = torch.randperm(per_seq * len(lens), generator=torch.Generator().manual_seed(args.seed)).tolist()
    tables = [blocks[b * per_seq:(b + 1) * per_seq] for b in range(len(lens))]
    shape = (per_seq * len(lens), 2, bs, args.kv_heads, args.head_dim)
    caches = {"torch": torch.zeros(shape, dtype=cache_dtype, device=dev)}
    caches["triton"] = caches["torch"].clone()
    backends = {"torch": TorchAttention(), "triton": TritonAttention()}
    kv_scales, scale = (0.05, 0.02), args.head_dim ** -0.5
    prefill_q = list(lens)
    prefill_q[-1] = lens[-1] - (lens[-1] // 2 // bs) * bs  # its first half is already cached
    steps = [(prefill_q, lens), ([1] * len(lens), [n + 1 for n in lens])]
    ok, worst = True, 0.0
    for q_lens, seq_lens in steps:
        meta = _metadata(q_lens, seq_lens, tables, bs, dev)
        t = sum(q_lens)
        q, k, v = (torch.randn(t, h, args.head_dim, generator=gen, device=dev).to(dtype)
                   for h in (args.heads, args.kv_heads, args.kv_heads))
        outs = {name: b.forward(q, k, v, caches[name], meta, scale, None, kv_scales) for name, b in backends.items()}
        worst = max(worst, (outs["triton"].float() - outs["torch"].float()).abs().max().item())
        ok &= bool(torch.isfinite(outs["triton"]).all())
        ok &= torch.equal(caches["torch"].view(torch.uint8), caches["triton"].view(torch.uint8))
    ok &= worst <= KV_TOL[dtype]
    # Timed: the decode step again (same metadata, the rewrite is idempotent).
    times = {name: time_ms(lambda b=b, name=name: b.forward(q, k, v, caches[name], meta, scale, None, kv_scales),
                           args.warmup, args.iters, dev) for name, b in backends.items()}
    return ok, (f"kv   fp8_{cache_name} {_dname(dtype)} seqs={len(lens)} context~{args.context} "
                f"H={args.heads} KVH={args.kv_heads} D={args.head_dim} max_err={worst:.2e} tol={KV_TOL[dtype]:.0e} "
                f"decode triton={times['triton']:.4f}ms torch={times['torch']:.4f}ms "
                f"{'PASS' if ok else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check_quant: no CUDA device available; this script only runs on a GPU machine.", file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check_quant: --device cpu needs TRITON_INTERPRET=1 in the environment.", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}  torch {torch.__version__}")
    failures = []
    checks = [(check_gemm, (scheme, m, DTYPES[d])) for scheme in args.schemes for d in args.dtypes for m in args.m]
    if not args.skip_kv:
        checks += [(check_kv, (kv, DTYPES[d])) for kv in KV_DTYPES for d in args.dtypes]
    for check, params in checks:
        try:
            ok, line = check(*params, args)
        except Exception as exc:  # a kernel that fails to compile or launch is a failed check
            ok, line = False, f"{check.__name__}{params}: {type(exc).__name__}: {exc} FAIL"
        print(line, flush=True)
        if not ok:
            failures.append(line)
    if failures:
        print(f"gpu_check_quant FAILED: {len(failures)} of {len(checks)} checks")
        return 1
    print("gpu_check_quant ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

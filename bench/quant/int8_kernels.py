"""Which int8 GEMM is fast on this CPU? The two kernels `--quantization int8` chooses
between at load (engine/quant/cpu_int8.py) against full precision, on the decode
step's shapes.

    python -m pdserve.bench.quant.int8_kernels [--rows 1,16,64] [--repeats 5] [--threads 1]

Kernels, each on `bench.engine.offline`'s model's projections (fused qkv, o, fused
gate_up, down, the LM head), weights quantized per output channel:

    fp32        F.linear on the float32 weight (oneDNN)
    oneDNN      the float32 weight prepacked for oneDNN (the engine's fast path)
    W8A16       engine/quant/linear.py's torch kernels: torch._weight_int8pack_mm on
                bfloat16 activations up to INT8PACK_MAX_ROWS rows, beyond one GEMM of
                the int8 weight widened to bfloat16 where the CPU computes in it
                natively, else to float32
    W8A8        engine/quant/cpu_int8.py: FBGEMM's int8 x int8 GEMM, each row scaled to
                its own range and quantized to 7 bits alone (batch-invariant), the
                weight prepacked once

Per kernel and row count: microseconds per call summed over the shapes (the median of
`--repeats` timed passes, kernels interleaved) and the speed-up over fp32; the relative
error of each int8 kernel against the fp32 GEMM. The last line:
`int8_speedup_w8a16_r1=X int8_speedup_w8a8_r1=Y` (rows 1, against fp32), beside the
ISA torch reports. Which one an engine runs, it measures at load on its own largest
layer and logs (`int8 kernel: ...`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.bench.common.entry import parse
from pdserve.bench.common.random_model import ModelSpec, decode_shapes
from pdserve.bench.common.stats import median
from pdserve.engine.prepacked import PrepackedLinear
from pdserve.engine.quant.config import online_scheme
from pdserve.engine.quant.linear import QuantLinear
from pdserve.services.common.flags import flag

KERNELS = ("fp32", "oneDNN", "W8A16", "W8A8")


@dataclass(frozen=True)
class Int8Flags:
    rows: str = flag("1,16,64", "row counts (tokens in a step), comma-separated")
    repeats: int = flag(5, "timed passes per kernel and row count (interleaved)")
    calls: int = flag(20, "calls of each shape per pass")
    threads: int = flag(1, "torch threads")
    quick: bool = flag(False, "rows 1 and 4, 2 passes of 2 calls (the smoke test)")


def kernels(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n, k = weight.shape
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    packed = PrepackedLinear.from_linear(linear)
    w8a16 = QuantLinear.from_float(linear, online_scheme("int8"))
    w8a16.prepare()
    w8a8 = QuantLinear.from_float(linear, online_scheme("int8"))
    w8a8.prepare()
    w8a8.use_w8a8()
    return {"fp32": lambda x: F.linear(x, weight), "oneDNN": packed, "W8A16": w8a16, "W8A8": w8a8}


def main(argv: list[str] | None = None) -> int:
    f = parse(Int8Flags, argv, "python -m pdserve.bench.quant.int8_kernels", __doc__)
    rows = [1, 4] if f.quick else [int(r) for r in f.rows.split(",")]
    repeats, calls = (2, 2) if f.quick else (f.repeats, f.calls)
    torch.set_num_threads(f.threads)
    spec = ModelSpec()
    gen = torch.Generator().manual_seed(0)
    layers = [(name, kernels(torch.randn(n, k, generator=gen) * k ** -0.5)) for name, k, n in decode_shapes(spec)]
    print(f"ISA: {torch.backends.cpu.get_cpu_capability()}, torch threads {f.threads}; shapes: "
          + ", ".join(f"{name} {k}x{n}" for name, k, n in decode_shapes(spec)))
    speedups: dict[tuple[str, int], float] = {}
    print(f"{'rows':>5} " + "".join(f"{name:>14}" for name in KERNELS) + f"{'err W8A16':>11}{'err W8A8':>10}")
    with torch.no_grad():
        for m in rows:
            inputs = {name: torch.randn(m, k, generator=gen) for name, k, _ in decode_shapes(spec)}
            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            for _ in range(repeats):
                for kernel in KERNELS:
                    start = time.perf_counter()
                    for name, ks in layers:
                        for _ in range(calls):
                            ks[kernel](inputs[name])
                    times[kernel].append((time.perf_counter() - start) / calls * 1e6)
            errors = {}
            for kernel in ("W8A16", "W8A8"):
                num = den = 0.0
                for name, ks in layers:
                    ref = ks["fp32"](inputs[name])
                    num += float((ks[kernel](inputs[name]) - ref).norm() ** 2)
                    den += float(ref.norm() ** 2)
                errors[kernel] = (num / den) ** 0.5
            us = {kernel: median(times[kernel]) for kernel in KERNELS}
            for kernel in KERNELS:
                speedups[(kernel, m)] = us["fp32"] / us[kernel]
            print(f"{m:>5} " + "".join(f"{us[k]:>8.0f} x{us['fp32'] / us[k]:<4.2f}" for k in KERNELS)
                  + f"{errors['W8A16']:>11.4f}{errors['W8A8']:>10.4f}")
    first = rows[0]
    print(f"int8_speedup_w8a16_r{first}={speedups[('W8A16', first)]:.3f} "
          f"int8_speedup_w8a8_r{first}={speedups[('W8A8', first)]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

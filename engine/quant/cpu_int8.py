"""int8 weights on a CPU through an int8 x int8 GEMM (W8A8), where it measures faster.

torch's CPU kernels for int8 weights read 16-bit activations (W8A16: engine/quant/
linear.py); without native bfloat16 (AVX2, AVX-512 without BF16) that is slower than
float32 beyond a few rows. FBGEMM's dynamic int8 GEMM (`quantized::linear_dynamic`)
quantizes the activations to int8 per call and runs int8 x int8 with int32 sums on
any x86 CPU (AVX2 and up): 1.3-2.6x float32 on this machine kind at 1-256 rows
(docs/benchmarks.md, "int8 on CPUs without AMX").

One catch: FBGEMM takes one activation range per call, over all its rows, so a
request's numbers would depend on what it is batched with. Here each row is first
scaled to its own max |x| = 1, and one extra row holding +1 and -1 pins the call's
range to [-1, 1] whatever the batch: every row is quantized alone (per token), the
extra row's output is dropped, and each output row is scaled back. A request's
numbers are the same in any batch (tests/engine/quant/test_cpu_int8.py).

Which kernel a model runs is measured once at load (`choose`): the largest layer
(but a tied LM head), at 1, 8 and 64 rows, both ways; W8A8 where it is faster on
balance (the geometric mean of its speed-ups over the three above CHOICE_MARGIN), one kernel for every
batch size, and the engine logs the figures. (At one row W8A8 loses on small layers:
its per-call quantization costs ~50 us, a 768x1280 GEMM ~100.) A layer on W8A8 holds the packed weight
instead of its int8 matrix (the same bytes, counted as that matrix), except a tied LM
head, whose matrix the embedding reads.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

# the W8A8 kernel's activations use 7 bits: FBGEMM's `reduce_range` on x86, where its
# int8 x int8 -> int16 pairwise sums would saturate at 8 bits
REDUCE_RANGE = True
BENCH_ROWS = (1, 8, 64)  # a lone decode, a small batch, a large batch or a prefill chunk
BENCH_ITERS = 10
# W8A8 only where it is clearly faster: its activations cost accuracy, and a choice near
# parity would flip between processes (a prefill and a decode worker of one cluster, an
# engine and its restart) with the machine's noise
CHOICE_MARGIN = 1.25


def available() -> bool:
    """Whether this torch has FBGEMM's int8 kernels (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def pack(weight: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    """FBGEMM's packed form of an int8 [N, K] weight with per-output-channel scales."""
    import warnings

    with warnings.catch_warnings():  # torch flags quantized tensors as deprecated; the kernels stay in 2.13
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(weight.cpu(), scale.double().cpu(),
                                                     torch.zeros(weight.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, None)


def pin_row(k: int) -> torch.Tensor:
    """The extra row that pins a call's activation range to [-1, 1] (module docstring)."""
    row = torch.zeros(1, k)
    row[0, 0], row[0, -1] = 1.0, -1.0
    return row


def linear(x: torch.Tensor, packed: torch.ScriptObject, pin: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float) -> float32 [M, N] = x W^T, each row quantized alone (module
    docstring); `pin` is pin_row(K). Few ops: at one row their overhead is the cost."""
    x = x.float()
    scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
    y = torch.ops.quantized.linear_dynamic(torch.cat((x / scale, pin)), packed, REDUCE_RANGE)
    return y[:-1].mul_(scale)


@dataclass(frozen=True)
class Choice:
    """The measured decision: microseconds a call of the largest layer took each way."""

    w8a8: bool
    shape: tuple[int, int]  # N, K of the layer timed
    times: dict[int, tuple[float, float]]  # rows -> (W8A16 us, W8A8 us)

    def log_line(self) -> str:
        figures = ", ".join(f"{rows} rows {a:.0f} us W8A16 vs {b:.0f} us W8A8" for rows, (a, b) in self.times.items())
        kernel = "W8A8 (FBGEMM, activations per token)" if self.w8a8 else "W8A16 (torch's int8 weight kernels)"
        return f"int8 kernel: {kernel}, the faster on balance on a {self.shape[0]}x{self.shape[1]} layer: {figures}"


def _best_us(fn, x: torch.Tensor) -> float:
    fn(x)
    best = float("inf")
    for _ in range(BENCH_ITERS):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def choose(w8a16, w8a8, shape: tuple[int, int], dtype: torch.dtype) -> Choice:
    """Time `w8a16(x)` and `w8a8(x)` (one layer's two kernels) at BENCH_ROWS rows."""
    times = {}
    with torch.no_grad():
        for rows in BENCH_ROWS:
            x = torch.randn(rows, shape[1], dtype=dtype)
            times[rows] = (_best_us(w8a16, x), _best_us(w8a8, x))
    speedup = math.prod(a / b for a, b in times.values()) ** (1 / len(times))
    return Choice(speedup > CHOICE_MARGIN, shape, times)

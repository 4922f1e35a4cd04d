"""GB/s of weights read by a decode-sized GEMM, `F.linear` against oneDNN-prepacked.

    python -m pdserve.bench.engine.gemm [--rows 1,4,8,16,32,64] [--repeats 3] [--threads 2]

For every projection of `bench.engine.offline`'s 100M-parameter model (fused qkv, o, fused
gate_up, down, the LM head) and every row count, the weights are held in enough
copies to exceed the caches (`--footprint-mb`, 256 by default), so each pass reads
them from memory as a decode step does, and one pass over all copies is timed with
each kernel, interleaved, `--repeats` times; the median is printed as GB/s of
weights read, with the machine's read bandwidth measured in the same run (a sum
over a 512 MB tensor, the best of 7) beside it; "all (a step)" weighs each projection by how
often a decode step runs it (once per layer; the LM head once). The last line is machine-readable:
`gemm_gbps_plain_r1=X gemm_gbps_packed_r1=Y read_gbps=Z` (rows 1, all shapes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.bench.common.entry import parse
from pdserve.bench.common.machine import read_bandwidth
from pdserve.bench.common.random_model import ModelSpec, decode_shapes  # noqa: F401  (gemm.decode_shapes)
from pdserve.bench.common.stats import median
from pdserve.engine.prepacked import PrepackedLinear
from pdserve.services.common.flags import flag


def _timed(fn: Callable[[], None]) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(in_features: int, out_features: int, rows: Sequence[int], footprint: int, repeats: int
            ) -> dict[int, tuple[float, float]]:
    """rows -> (plain GB/s, packed GB/s), medians over interleaved repetitions."""
    nbytes = in_features * out_features * 4
    copies = max(1, -(-footprint // nbytes))
    gen = torch.Generator().manual_seed(in_features * 7919 + out_features)
    weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(copies)]
    packed = [PrepackedLinear(w, None) for w in weights]
    out: dict[int, tuple[float, float]] = {}
    for m in rows:
        x = torch.randn(m, in_features, generator=gen)

        def plain_pass() -> None:
            for w in weights:
                F.linear(x, w)

        def packed_pass() -> None:
            for layer in packed:
                layer(x)

        plain_t, packed_t = [], []
        for _ in range(repeats):
            plain_t.append(_timed(plain_pass))
            packed_t.append(_timed(packed_pass))
        total = nbytes * copies
        out[m] = (total / median(plain_t) / 1e9, total / median(packed_t) / 1e9)
    return out


@dataclass(frozen=True)
class GemmFlags:
    rows: tuple[int, ...] = flag((1, 4, 8, 16, 32, 64), "rows of x (tokens in a decode step), comma-separated")
    repeats: int = flag(3, "timed passes per kernel (the median is printed)")
    threads: int = flag(2, "torch threads")
    footprint_mb: int = flag(256, "MB of weight copies per projection: more than the caches hold")
    quick: bool = flag(False, "two row counts, one repetition, 64 MB")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(GemmFlags, argv, "python -m pdserve.bench.engine.gemm", __doc__)
    rows = list(args.rows)
    repeats, footprint = args.repeats, args.footprint_mb * 2**20
    if args.quick:
        rows, repeats, footprint = rows[:2], 1, 64 * 2**20
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        bw = read_bandwidth()
        print(f"threads={torch.get_num_threads()} read bandwidth {bw:.1f} GB/s (sum over 512 MB, best of 7)")
        print(f"{'gemm':<13} {'rows':>4} {'plain GB/s':>10} {'packed GB/s':>11} {'packed/plain':>12} "
              f"{'packed/read bw':>14}")
        sums: dict[int, list[float]] = {m: [0.0, 0.0, 0.0] for m in rows}  # bytes, plain s, packed s
        spec = ModelSpec()
        for name, k, n in decode_shapes(spec):
            for m, (plain, packed) in measure(k, n, rows, footprint, repeats).items():
                print(f"{name:<13} {m:>4} {plain:>10.1f} {packed:>11.1f} {packed / plain:>12.2f} {packed / bw:>14.2f}")
                # a step runs each layer's projections once per layer, the LM head once
                nbytes = k * n * 4 * (1 if name == "lm_head" else spec.num_layers)
                sums[m][0] += nbytes
                sums[m][1] += nbytes / plain
                sums[m][2] += nbytes / packed
    for m, (nbytes, plain_s, packed_s) in sums.items():
        print(f"{'all (a step)':<13} {m:>4} {nbytes / plain_s:>10.1f} {nbytes / packed_s:>11.1f} "
              f"{plain_s / packed_s:>12.2f} {nbytes / packed_s / bw:>14.2f}")
    first = sums[rows[0]]
    print(f"gemm_gbps_plain_r{rows[0]}={first[0] / first[1]:.2f} gemm_gbps_packed_r{rows[0]}={first[0] / first[2]:.2f} "
          f"read_gbps={bw:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

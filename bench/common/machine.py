"""The machine a benchmark runs on, measured beside its figures: how busy it is, and
how fast it reads memory (the floor a memory-bound step cannot beat)."""

from __future__ import annotations

import math
import os
import time


def machine_load() -> str:
    """The 1-minute load average (taken before the benchmark adds its own) against the CPU
    count: timings taken on a busy machine are not comparable. With more runnable threads
    than cores, OpenMP barriers stall and small ops can slow down 10x or more, unevenly across
    the three systems."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    warning = "  WARNING: machine busy, timings unreliable" if load > 0.5 * cpus else ""
    return f"load_avg_1m={load:.2f} cpus={cpus}{warning}"


def read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """The memory's read bandwidth in GB/s: the best of timed sums over a tensor far
    larger than any cache, on torch's threads (the same ones the model uses). The best,
    not the median: a floor computed from it is the strictest one the machine allows."""
    import torch  # only here: machine_load stays light

    big = torch.ones(megabytes * 2**20 // 4)
    big.sum()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9

"""The CPUs a process may compute on: its affinity, capped by its cgroup's CPU quota.

A container limited to 4 CPUs on a 64-core node sees all 64 in its affinity; 64 torch
threads sharing 4 CPUs' worth of time run slower than 4 threads, so the quota counts
(cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Cpus:
    """The CPUs this process may run on (its affinity, in order) and how many of them it
    may keep busy at once (`usable`: at most len(ids), fewer under a cgroup quota)."""

    ids: tuple[int, ...]
    usable: int
    quota: float | None  # the cgroup's CPU limit in CPUs, None when unlimited

    def describe(self) -> str:
        limit = f", cgroup CPU limit {self.quota:g}" if self.quota is not None else ""
        return f"{len(self.ids)} CPUs in its affinity ({format_cpus(self.ids)}){limit}"


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, own: str | None = None) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 2.5), None when unlimited or
    unreadable. `own`: the process's cgroup v2 path (from /proc/self/cgroup; inside a
    container it is "/", the container's own cgroup)."""
    if own is None:
        try:
            own = next((line[3:].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                        if line.startswith("0::")), "/")
        except OSError:
            own = "/"
    quota = period = ""
    for where in dict.fromkeys((root / own.lstrip("/"), root)):  # v2: "max 100000" or "250000 100000"
        try:
            quota, period = (where / "cpu.max").read_text().split()[:2]
            break
        except (OSError, ValueError):
            continue
    else:
        try:  # v1
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        value = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None


def this_process(root: Path = CGROUP_ROOT) -> Cpus:
    ids = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(
        range(os.cpu_count() or 1))
    quota = cgroup_cpu_limit(root)
    usable = len(ids) if quota is None else max(1, min(len(ids), math.ceil(quota)))
    return Cpus(ids, usable, quota)


def format_cpus(ids: tuple[int, ...] | list[int]) -> str:
    """'0-3,8,10-11': the form --cpu-affinity and --worker-cpus take."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)

"""Where a local launch's processes compute (`pdserve up --launcher local` on a CPU).

By default each worker gets a disjoint share of the cores this launcher may use (its
affinity, capped by its cgroup's CPU limit) and one torch thread per core of it; the
routers get what is left over, plus one core in every ROUTER_SHARE on machines with
at least that many, so that streaming tokens out (gRPC, HTTP/SSE, detokenization)
does not take cycles from a worker's step. Workers sharing a core with each other
wait on each other's OpenMP barriers, hence disjoint shares.

Nothing is decided here when the operator decided: --worker-cpus, a worker
--cpu-affinity or --torch-threads keep their meaning, and a GPU device is left alone.
When the workers outnumber the cores, no share is disjoint: they stay unpinned with
one torch thread each.

    cores 2,  1 mixed worker          -> mixed-0 0-1, routers unpinned
    cores 2,  1 prefill + 1 decode    -> prefill-0 0, decode-0 1, routers unpinned
    cores 3,  1 prefill + 1 decode    -> prefill-0 0, decode-0 1, routers 2
    cores 16, 1 prefill + 1 decode    -> prefill-0 0-6, decode-0 7-13, routers 14-15
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from pdserve.launch.cluster import ClusterSpec
from pdserve.services.common.cpus import Cpus, format_cpus

ROUTER_SHARE = 8  # one core in this many goes to the routers (machines with at least this many)


@dataclass(frozen=True)
class Placement:
    workers: tuple[tuple[int, ...], ...]  # each worker's cores, in start order (prefill, mixed, decode)
    routers: tuple[int, ...]  # the routers' cores; () when none is to spare (they float)

    @property
    def worker_env(self) -> dict[str, str]:
        """What the workers' environment adds: with the routers on their cores, OpenMP
        threads that wait passively. An idle OpenMP thread spins for a while after each
        parallel region by default, taking the cycles a router streaming tokens needs
        (measured on 2 cores, one mixed worker at 64 requests in flight: 0.90x the
        one-thread throughput spinning, 1.10x passive; docs/benchmarks.md, issue 38)."""
        return {} if self.routers else {"OMP_WAIT_POLICY": "PASSIVE"}


def place(cores: Sequence[int], workers: int) -> Placement | None:
    """Disjoint shares of `cores` for `workers` workers and the rest for the routers;
    None when there are fewer cores than workers."""
    if workers < 1 or len(cores) < workers:
        return None
    spare = len(cores) // ROUTER_SHARE
    each = (len(cores) - spare) // workers
    shares = tuple(tuple(cores[i * each:(i + 1) * each]) for i in range(workers))
    return Placement(shares, tuple(cores[workers * each:]))


def place_local(spec: ClusterSpec, cpus: Cpus) -> tuple[ClusterSpec, Placement | None, str]:
    """`spec` with the default placement filled in (--worker-cpus, or one torch thread
    each when the cores are too few), the placement, and a line saying what was chosen
    and why."""
    launch, worker = spec.launch, spec.worker
    if launch.cpu_lists or worker.cpu_affinity or worker.torch_threads is not None:
        return spec, None, "workers placed as asked (--worker-cpus / --cpu-affinity / --torch-threads)"
    if worker.device != "cpu":
        return spec, None, f"workers on {worker.device}: not pinned, torch's default CPU threads"
    count = launch.prefill + launch.mixed + launch.decode
    cores = cpus.ids[:cpus.usable]
    placement = place(cores, count)
    if placement is None:
        return (replace(spec, worker=replace(worker, torch_threads=1)), None,
                f"{count} workers on {len(cores)} usable CPUs ({cpus.describe()}): too few to share, "
                "workers not pinned, one torch thread each")
    names = ([f"prefill-{i}" for i in range(launch.prefill)] + [f"mixed-{i}" for i in range(launch.mixed)]
             + [f"decode-{i}" for i in range(launch.decode)])
    shares = ", ".join(f"{name} {format_cpus(share)}" for name, share in zip(names, placement.workers))
    routers = (f"routers {format_cpus(placement.routers)}" if placement.routers
               else "routers unpinned (no core to spare), so workers' OpenMP threads wait passively")
    worker_cpus = ";".join(format_cpus(share) for share in placement.workers)
    return (replace(spec, launch=replace(launch, worker_cpus=worker_cpus)), placement,
            f"{cpus.describe()}: {shares}, one torch thread per core; {routers}")

"""The KV offload benchmark's parts (its entry point is bench/offload/__main__.py):
the multi-turn workload (bench/serving/multiturn.py) on engines and clusters whose
device pool holds about a quarter of the conversations' KV, with and without the
tiers below it (engine/offload/).

    sizing      the conversations' KV in blocks -> device pool (a quarter of it, and
                never less than the conversations in flight need), host tier (all of it)
    one engine  EngineBackend (bench/offload/engine_backend.py): an LLMEngine in this
                process, a fresh one per run (cold pool, cold tiers), its EngineStats
                read after the run (hits per tier, onload seconds)
    1P+1D       a local cluster per system (bench/cluster/clusters.py), workers given
                the --kv-offload-* settings, the gRPC backend
    runs        every comparison interleaved (A B A B, bench/common/repeat.py), each
                repetition its own seeded conversations; ratios per repetition, their
                median and range (bench/common/stats.py)

The modes: tiers off vs a host tier (engine and cluster), a disk tier alone (host 0)
per block size with what a disk hit costs against recomputing the block, and the
eviction policies (lru, arc) on one trace with a host tier too small for it.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from pdserve.bench.common.stats import Ratio, median, safe_div
from pdserve.bench.serving.backend import InFlight
from pdserve.bench.serving.metrics import Slo
from pdserve.bench.serving.multiturn import Conversation, make_conversations, measure_conversations
from pdserve.bench.serving.run import Measured
from pdserve.bench.serving.workloads import ArrivalConfig, BenchRequest, WorkloadConfig, random_ids


@dataclass(frozen=True)
class OffloadConfig:
    workload: WorkloadConfig = WorkloadConfig(kind="multiturn", num_requests=16, turns=(5, 10),
                                              prompt_tokens=(32, 64), output_tokens=(8, 16), think_time=0.5)
    concurrency: int = 0  # conversations in flight at once (0: all of them, each thinking between its turns)
    request_rate: float = 8.0  # conversations started per second (Poisson)
    model: str | None = None  # a model directory; None: a random Llama of `shape` (the embedded one with `embedded`)
    embedded: bool = False
    shape: Any = None  # bench/cluster/clusters.ModelShape; None: its default (12M parameters)
    block_size: int = 16
    device_fraction: float = 0.25  # of the conversations' KV blocks, in the device pool
    host_factor: float = 1.25  # host tier: this times the conversations' KV
    policy_host_fraction: float = 0.5  # the policy comparison's host tier, of the conversations' KV
    disk_block_sizes: tuple[int, ...] = (16, 64)
    disk_parent: str | None = None  # where the disk tier's directories go (None: the system's temporary directory)
    repeats: int = 2
    engine: bool = True
    cluster: bool = True
    disk: bool = True
    policies: bool = True
    torch_threads: int = 1
    timeout: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload.kind != "multiturn":
            raise ValueError("the offload benchmark runs the multiturn workload")
        if not 0 < self.device_fraction <= 1:
            raise ValueError(f"--device-fraction: in (0, 1], got {self.device_fraction}")
        if not self.host_factor >= 1:
            raise ValueError(f"--host-factor: must be >= 1 (the host tier holds every block), got {self.host_factor}")
        if not 0 < self.policy_host_fraction < 1:
            raise ValueError(f"--policy-host-fraction: in (0, 1), got {self.policy_host_fraction}")
        if self.repeats < 1:
            raise ValueError(f"--repeats: must be >= 1, got {self.repeats}")
        if self.concurrency < 0:
            raise ValueError(f"--concurrency: must be >= 0, got {self.concurrency}")
        for size in (self.block_size, *self.disk_block_sizes):
            if size < 1 or size & (size - 1):
                raise ValueError(f"block sizes: powers of two, got {size}")


# -- sizing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    block_size: int
    kv_blocks: int  # every conversation's whole history, in blocks
    floor_blocks: int  # the least a device pool may have: twice the longest conversation's blocks
    device_blocks: int
    block_bytes: int  # one block's KV, all layers

    def host_bytes(self, factor: float) -> int:
        return int(self.kv_blocks * factor) * self.block_bytes

    def describe(self) -> str:
        return (f"block_size={self.block_size}: conversations' KV {self.kv_blocks} blocks "
                f"({self.kv_blocks * self.block_bytes / 2**20:.1f} MiB), device pool {self.device_blocks} blocks "
                f"({self.device_blocks / self.kv_blocks:.0%}; at least {self.floor_blocks}: twice the longest conversation)")


def kv_block_bytes(model_dir: str, block_size: int, dtype_bytes: int = 4) -> int:
    """One block's K and V over all layers (fp32 pages) from the model's config.json."""
    import json

    c = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * kv_heads * head_dim * block_size * dtype_bytes


def size(conversations: Sequence[Conversation], block_size: int, fraction: float, model_dir: str) -> Sizing:
    """`fraction` of the conversations' blocks in the device pool, but room for the
    longest conversation's last turn twice over (a request must fit, and a pool that
    holds one request at a time measures the scheduler, not the tiers)."""
    blocks = [math.ceil(c.longest() / block_size) for c in conversations]
    floor = 2 * max(blocks)
    return Sizing(block_size, sum(blocks), floor, max(int(sum(blocks) * fraction), floor),
                  kv_block_bytes(model_dir, block_size))


# -- one run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One system's run: the serving figures and its tiers' counters."""

    label: str
    run: Measured
    host_hits: int = 0
    host_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    onloaded_blocks: int = 0
    onload_seconds: float = 0.0
    onload_failures: int = 0  # copies up that failed or ran past their deadline (recomputed)
    offloads_dropped: int = 0  # the offload queue was full (or a copy expired): not copied down

    @property
    def ttft_p50(self) -> float:
        return self.run.summary.ttft.p50

    @property
    def ttft_p99(self) -> float:
        return self.run.summary.ttft.p99

    @property
    def throughput(self) -> float:
        return self.run.summary.output_throughput

    @property
    def host_hit_rate(self) -> float:
        return _rate(self.host_hits, self.host_misses)

    @property
    def disk_hit_rate(self) -> float:
        return _rate(self.disk_hits, self.disk_misses)

    @property
    def cached_fraction(self) -> float:
        s = self.run.summary
        return s.cached_tokens / s.input_tokens if s.input_tokens else math.nan

    def line(self) -> str:
        s = self.run.summary
        tiers = ""
        if self.host_hits + self.host_misses:
            tiers += f" host_hit_rate={self.host_hit_rate:.3f}"
        if self.disk_hits + self.disk_misses:
            tiers += f" disk_hit_rate={self.disk_hit_rate:.3f}"
        if self.onload_failures or self.offloads_dropped:
            tiers += f" onload_failures={self.onload_failures} offloads_dropped={self.offloads_dropped}"
        return (f"{self.label}: ttft_p50={self.ttft_p50:.1f}ms ttft_p99={self.ttft_p99:.1f}ms "
                f"output_tok_s={self.throughput:.2f} cached={self.cached_fraction:.3f} "
                f"requests={s.completed}/{s.num_requests}{tiers}")


def _rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else math.nan


def engine_config(model: str, block_size: int, num_blocks: int, **offload: Any):
    from pdserve.engine.config import CacheConfig, EngineConfig  # torch: only when engines run

    return EngineConfig(model=model, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks), **offload)


@contextmanager
def engine_backend(config, label: str, threads: int) -> Iterator[Any]:
    import torch

    from pdserve.bench.offload.engine_backend import EngineBackend
    from pdserve.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    engine = LLMEngine(config)
    try:
        with EngineBackend(engine, label) as backend:
            yield backend
    finally:
        engine.close()


def run_engine(config, label: str, conversations: Sequence[Conversation], cfg: OffloadConfig) -> Outcome:
    """A fresh engine, warmed up, then the conversations; its tier counters after."""
    with engine_backend(config, label, cfg.torch_threads) as backend:
        warm(backend, backend.served().vocab_size, cfg.timeout)
        run = measure_conversations(backend, conversations, concurrency=cfg.concurrency, timeout=cfg.timeout,
                                    slo=Slo(), label=label, progress=False)
        backend.engine.check_integrity()
        stats = backend.stats().kv_offload
    host, disk = stats.host, stats.disk
    return Outcome(label, run, host.hits if host else 0, host.misses if host else 0, disk.hits if disk else 0,
                   disk.misses if disk else 0, stats.onloaded_blocks, stats.onload_seconds_sum, stats.onload_failures,
                   stats.offloads_dropped + stats.offloads_expired)


def warm(backend, vocab: int, timeout: float) -> None:
    """Two short requests, unmeasured (first passes; nothing a conversation reuses)."""
    inflight = InFlight()
    for i in range(2):
        prompt = random_ids(40, vocab, random.Random(f"warm-{i}"))
        result = backend.send(BenchRequest(-1 - i, prompt, 4, 0.0), timeout, inflight)
        if not result.ok:
            raise RuntimeError(f"warm-up request failed: {result.error}")


def prefill_seconds_per_block(backend, vocab: int, block_size: int, timeout: float, tokens: int = 512) -> float:
    """What recomputing one block costs: a fresh prompt's TTFT (1 token out) over its blocks."""
    inflight = InFlight()
    best = math.inf
    for i in range(3):
        prompt = random_ids(tokens, vocab, random.Random(f"prefill-{i}-{time.perf_counter()}"))
        result = backend.send(BenchRequest(-10 - i, prompt, 1, 0.0), timeout, inflight)
        if result.ok:
            best = min(best, result.ttft)
    return best / (tokens / block_size)


# -- the comparisons ------------------------------------------------------------------------


Log = Callable[[str], None]


@dataclass(frozen=True)
class Served:
    model: str  # directory
    vocab_size: int
    max_model_len: int


def served(model_dir: str) -> Served:
    import json

    c = json.loads((Path(model_dir) / "config.json").read_text())
    return Served(model_dir, c["vocab_size"], c["max_position_embeddings"])


def conversations_for(cfg: OffloadConfig, model: Served, rep: int) -> list[Conversation]:
    """Repetition `rep`'s conversations: their own seed, so no run reuses another's KV."""
    return make_conversations(replace(cfg.workload, seed=cfg.seed + rep), ArrivalConfig(cfg.request_rate),
                              model.vocab_size, model.max_model_len)


def compare(systems: dict[str, Callable[[list[Conversation]], Outcome]], cfg: OffloadConfig, model: Served,
            log: Log) -> dict[str, list[Outcome]]:
    """Every system on each repetition's conversations, interleaved; one line per run."""
    from pdserve.bench.common.repeat import interleaved

    def system(name: str, run: Callable[[list[Conversation]], Outcome]) -> Callable[[int], Outcome]:
        def one(rep: int) -> Outcome:
            outcome = run(conversations_for(cfg, model, rep))
            log(f"  {outcome.line()}")
            return outcome
        return one

    return interleaved({name: system(name, run) for name, run in systems.items()}, cfg.repeats, log)


@dataclass
class Report:
    """What the run found: lines printed as they come, the figures for the last line,
    and problems (a report that does not hold together)."""

    log: Log
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self, outcomes: dict[str, list[Outcome]], tiers: dict[str, bool]) -> None:
        for name, runs in outcomes.items():
            for rep, o in enumerate(runs, 1):
                where = f"{name} repeat {rep}"
                self.problems += [f"{where}: {p}" for p in o.run.problems()]
                if o.run.summary.failed:
                    self.problems.append(f"{where}: {o.run.summary.failed} requests failed "
                                         f"({o.run.summary.errors[:1]})")
                if not tiers.get(name, False) and (o.host_hits or o.disk_hits or o.onloaded_blocks):
                    self.problems.append(f"{where}: tiers off, yet {o.host_hits + o.disk_hits} tier hits")
                if o.onloaded_blocks > o.host_hits + o.disk_hits:
                    self.problems.append(f"{where}: {o.onloaded_blocks} blocks onloaded, only "
                                         f"{o.host_hits + o.disk_hits} tier hits")

    def ratios(self, title: str, off: list[Outcome], on: list[Outcome]) -> tuple[Ratio, Ratio, Ratio]:
        p50 = Ratio.paired([o.ttft_p50 for o in off], [o.ttft_p50 for o in on])
        p99 = Ratio.paired([o.ttft_p99 for o in off], [o.ttft_p99 for o in on])
        tput = Ratio.paired([o.throughput for o in on], [o.throughput for o in off])
        self.log(f"{title} TTFT p50 off/on: {p50}")
        self.log(f"{title} TTFT p99 off/on: {p99}")
        self.log(f"{title} output throughput on/off: {tput}")
        return p50, p99, tput


def tiers_off_vs_on(cfg: OffloadConfig, model: Served, sizing: Sizing, report: Report) -> None:
    """One engine: the device pool alone, then with a host tier holding every block."""
    host = sizing.host_bytes(cfg.host_factor)
    report.log(f"== one engine (in process): tiers off vs host tier of {host / 2**20:.1f} MiB ==")
    off = engine_config(model.model, sizing.block_size, sizing.device_blocks)
    on = engine_config(model.model, sizing.block_size, sizing.device_blocks, kv_offload_host_bytes=host)
    runs = compare({"engine-off": lambda c: run_engine(off, "engine-off", c, cfg),
                    "engine-host": lambda c: run_engine(on, "engine-host", c, cfg)}, cfg, model, report.log)
    report.check(runs, {"engine-host": True})
    p50, p99, tput = report.ratios("engine", runs["engine-off"], runs["engine-host"])
    hit = median([o.host_hit_rate for o in runs["engine-host"]])
    report.log(f"engine host-tier hit rate (blocks missing the device pool found in the host tier): {hit:.3f}")
    report.figures.update(ttft_p50=p50, ttft_p99=p99, throughput=tput, host_hit_rate=hit, engine=runs)


def cluster_off_vs_on(cfg: OffloadConfig, model: Served, sizing: Sizing, report: Report) -> None:
    """1 prefill + 1 decode worker, each with the device pool alone or with a host tier."""
    from contextlib import ExitStack

    from pdserve.bench.cluster.clusters import ClusterConfig, local_cluster
    from pdserve.bench.serving.backend import GrpcBackend
    from pdserve.services.router.client import Client

    host = sizing.host_bytes(cfg.host_factor)
    report.log(f"== 1P+1D cluster (processes, gRPC): tiers off vs host tier of {host / 2**20:.1f} MiB per worker ==")
    base = ClusterConfig(model=model.model, prefill=1, decode=1, num_blocks=sizing.device_blocks,
                         torch_threads=cfg.torch_threads, block_size=sizing.block_size, metrics=False)
    configs = {"cluster-off": base,
               "cluster-host": replace(base, worker_options=(("kv_offload_host_bytes", host),))}
    with ExitStack() as stack:
        backends = {}
        for name, c in configs.items():
            started = stack.enter_context(local_cluster(c))
            client = stack.enter_context(Client(started.address, timeout=cfg.timeout))
            backends[name] = GrpcBackend(client)

        def run(name: str, conversations: list[Conversation]) -> Outcome:
            backend = backends[name]
            warm(backend, model.vocab_size, cfg.timeout)
            return Outcome(name, measure_conversations(backend, conversations, concurrency=cfg.concurrency,
                                                       timeout=cfg.timeout, slo=Slo(), label=name, progress=False))

        runs = compare({name: (lambda c, n=name: run(n, c)) for name in configs}, cfg, model, report.log)
    report.check(runs, {"cluster-host": True})
    p50, p99, tput = report.ratios("cluster", runs["cluster-off"], runs["cluster-host"])
    report.figures.update(cluster_ttft_p50=p50, cluster_ttft_p99=p99, cluster_throughput=tput, cluster=runs)


@contextmanager
def cold_page_cache(directory: str, period: float = 0.02) -> Iterator[None]:
    """While the block runs, drop the page cache's copy of every file in `directory`
    every `period` seconds (posix_fadvise DONTNEED: only this directory's clean pages,
    so the files must be fsynced; nothing else on the machine is touched): a disk hit
    then reads the device, as after a restart or under memory pressure."""
    stop = threading.Event()

    def drop() -> None:
        while not stop.wait(period):
            for path in Path(directory).glob("*"):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:  # renamed or deleted meanwhile
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    thread = threading.Thread(target=drop, name="drop-page-cache", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def disk_alone(cfg: OffloadConfig, model: Served, report: Report) -> None:
    """A disk tier and no host tier, per block size: what a disk hit costs (onload
    seconds per block, with the page cache warm and kept cold) against recomputing
    the block (a fresh prompt's prefill per block), and the workload's TTFT with each."""
    report.log("== disk tier alone (host tier 0), per block size ==")
    report.log("  warm: the files as written (the page cache keeps them); cold: files fsynced and their pages "
               "dropped every 20 ms (posix_fadvise DONTNEED on the tier's files only)")
    for block_size in cfg.disk_block_sizes:
        conversations = conversations_for(cfg, model, 0)
        sizing = size(conversations, block_size, cfg.device_fraction, model.model)
        report.log(f"  {sizing.describe()}")
        off = engine_config(model.model, block_size, sizing.device_blocks)
        with engine_backend(off, f"recompute-{block_size}", cfg.torch_threads) as backend:
            warm(backend, model.vocab_size, cfg.timeout)
            recompute = prefill_seconds_per_block(backend, model.vocab_size, block_size, cfg.timeout)

        def disk_run(kind: str, conv: list[Conversation]) -> Outcome:
            with tempfile.TemporaryDirectory(prefix="pdserve-kv-disk-", dir=cfg.disk_parent) as directory:
                config = engine_config(model.model, block_size, sizing.device_blocks, kv_offload_dir=directory,
                                       kv_offload_disk_bytes=sizing.host_bytes(cfg.host_factor),
                                       kv_offload_fsync=kind == "cold")
                with cold_page_cache(directory) if kind == "cold" else nullcontext():
                    return run_engine(config, f"disk-{kind}-{block_size}", conv, cfg)

        names = {f"off-{block_size}": lambda c: run_engine(off, f"off-{block_size}", c, cfg),
                 f"disk-warm-{block_size}": lambda c: disk_run("warm", c),
                 f"disk-cold-{block_size}": lambda c: disk_run("cold", c)}
        runs = compare(names, replace(cfg, repeats=1), model, report.log)
        report.check(runs, {f"disk-warm-{block_size}": True, f"disk-cold-{block_size}": True})
        base = runs[f"off-{block_size}"][0]
        figures = {"recompute_ms_per_block": recompute * 1e3}
        for kind in ("warm", "cold"):
            d = runs[f"disk-{kind}-{block_size}"][0]
            per_block = d.onload_seconds / d.onloaded_blocks if d.onloaded_blocks else math.nan
            report.log(f"  block_size={block_size} {kind}: disk hit {per_block * 1e3:.3f} ms/block (onload, over "
                       f"{d.onloaded_blocks} blocks) vs recompute {recompute * 1e3:.3f} ms/block: recompute/disk "
                       f"{safe_div(recompute, per_block):.2f}x; disk_hit_rate={d.disk_hit_rate:.3f}; "
                       f"TTFT p50 off/disk {safe_div(base.ttft_p50, d.ttft_p50):.2f}")
            figures[f"{kind}_disk_ms_per_block"] = per_block * 1e3
            figures[f"{kind}_disk_hit_rate"] = d.disk_hit_rate
        report.figures[f"disk_{block_size}"] = figures


def policies(cfg: OffloadConfig, model: Served, sizing: Sizing, report: Report) -> None:
    """LRU and ARC on the same conversations, the host tier too small for all of them."""
    host = int(sizing.kv_blocks * cfg.policy_host_fraction) * sizing.block_bytes
    report.log(f"== eviction policies: host tier {cfg.policy_host_fraction:.0%} of the conversations' KV "
               f"({host / 2**20:.1f} MiB), same trace ==")
    configs = {p: engine_config(model.model, sizing.block_size, sizing.device_blocks, kv_offload_host_bytes=host,
                                kv_offload_policy=p) for p in ("lru", "arc")}
    runs = compare({p: (lambda conv, p=p: run_engine(configs[p], p, conv, cfg)) for p in configs}, cfg, model,
                   report.log)
    report.check(runs, {"lru": True, "arc": True})
    report.log(f"  {'policy':<8}{'host hit rate':>14}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'out tok/s':>11}")
    for p, outcomes in runs.items():
        report.log(f"  {p:<8}{median([o.host_hit_rate for o in outcomes]):>14.3f}"
                   f"{median([o.ttft_p50 for o in outcomes]):>13.1f}{median([o.ttft_p99 for o in outcomes]):>13.1f}"
                   f"{median([o.throughput for o in outcomes]):>11.2f}")
    report.figures["policies"] = runs


def isa() -> str:
    """The CPU instruction set torch's kernels use (AVX2, AVX512, ...), or the device."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def last_line(figures: dict[str, Any]) -> str:
    """The one-engine comparison's figures (nan without it: --no-engine)."""
    nan = Ratio(math.nan, math.nan, math.nan, 0)
    return (f"offload_ttft_p50_ratio={figures.get('ttft_p50', nan).median:.3f} "
            f"offload_throughput_ratio={figures.get('throughput', nan).median:.3f} "
            f"host_hit_rate={figures.get('host_hit_rate', math.nan):.3f}")

"""Clusters the benchmarks start for themselves: a router and workers as processes
(`launch.local.LocalCluster`), logs in a temporary directory whose tails are printed
if the cluster fails to start, stopped on the way out (also on Ctrl-C or an error).
Imports torch only when a cluster is started, so `--addr` runs stay light."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.services.router.client import Client


@dataclass(frozen=True)
class ModelShape:
    """A random-initialised Llama saved for a run (12M parameters by default: big
    enough on a CPU that a long prompt's prefill costs ~50 decode steps)."""

    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    vocab_size: int = 8192
    max_position_embeddings: int = 2048


# ~1B parameters, for the GPU modes.
GPU_MODEL = ModelShape(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632,
                       vocab_size=32000, max_position_embeddings=8192)


def save_model(shape: ModelShape, path: Path, seed: int) -> None:
    from pdserve.bench.common.random_model import ModelSpec, save_random_model  # torch, transformers: only here

    save_random_model(ModelSpec(**asdict(shape)), path, seed)


@dataclass(frozen=True)
class ClusterConfig:
    """Router + workers; the defaults are `pdserve up`'s topology (1 prefill + 1
    decode worker, the KV crossing over ZeroMQ tcp)."""

    model: str | None = None  # None: the embedded default model
    prefill: int = 1
    decode: int = 1
    mixed: int = 0
    num_blocks: int | None = None
    block_size: int = 16
    torch_threads: int = 1
    kv_connector: str | None = None  # None: the launcher's default (ZeroMQ tcp); "": none
    worker_cpus: str = ""  # LaunchConfig.worker_cpus: '0;1' pins worker k to the k-th list
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefill_policy: str = "prefix"
    local_prefill_threshold: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    startup_timeout: float = 180.0
    metrics: bool = True  # Prometheus metrics in every service (--no-metrics: off, to measure their cost)
    http: bool = False  # the router's OpenAI-compatible HTTP API too, on a free port
    # more WorkerConfig fields, by name (e.g. (("kv_offload_host_bytes", 1 << 30),)): what a
    # benchmark of one feature sets on every worker
    worker_options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Started:
    address: str  # the router's
    pids: dict[str, int]  # "router" and worker ids
    openai_url: str = ""  # its HTTP API's base URL (…/v1), answering; "" without ClusterConfig.http
    router_metrics: str = ""  # host:port of the router's /metrics; "" with metrics off

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, all threads) each process has used so far."""
        return {name: process_cpu_seconds(pid) for name, pid in self.pids.items()}


def process_cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def local_cluster(cfg: ClusterConfig) -> Iterator[Started]:
    """A LocalCluster for the duration of the block."""
    from pdserve.launch.cluster import wait_http
    from pdserve.launch.local import ClusterSpec, LaunchConfig, LocalCluster, StartupError  # torch: only here
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.worker.config import WorkerConfig

    model = {"model": cfg.model} if cfg.model else {}
    spec = ClusterSpec(
        RouterConfig(port=0, log_level="WARNING", prefill_policy=cfg.prefill_policy,
                     local_prefill_threshold=cfg.local_prefill_threshold, metrics=cfg.metrics,
                     http_port=0 if cfg.http else None, **model),
        WorkerConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size, torch_threads=cfg.torch_threads, kv_connector=cfg.kv_connector,
                     enable_prefix_caching=cfg.enable_prefix_caching, max_num_batched_tokens=cfg.max_num_batched_tokens,
                     max_num_seqs=cfg.max_num_seqs, device=cfg.device, dtype=cfg.dtype, log_level="WARNING",
                     metrics=cfg.metrics, **model, **dict(cfg.worker_options)),
        LaunchConfig(prefill=cfg.prefill, decode=cfg.decode, mixed=cfg.mixed, startup_timeout=cfg.startup_timeout,
                     worker_cpus=cfg.worker_cpus),
    )
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as logs:
        cluster = LocalCluster(spec, log_dir=logs)
        try:
            address = cluster.start()  # stops what it started before raising
        except StartupError:
            print_log_tails(Path(logs))
            raise
        try:
            openai_url = cluster.openai_url() if cfg.http else ""
            if openai_url:
                wait_http(openai_url, cfg.startup_timeout)
            metrics = cluster.metrics_targets()[0] if cfg.metrics else ""  # the router's comes first
            yield Started(address, {name: p.pid for name, p in cluster.processes.items()}, openai_url, metrics)
        finally:
            cluster.stop()


@dataclass(frozen=True)
class Up:
    """A started cluster and a client of its router."""

    started: Started
    client: Client


@contextlib.contextmanager
def clusters_up(configs: Mapping[str, ClusterConfig], model: ModelShape | None, seed: int,
                timeout: float) -> Iterator[dict[str, Up]]:
    """Every cluster started (all at once: most of a start is waiting for imports and
    registrations) before the block runs, all serving one model: `model` saved to a
    temporary directory, or the embedded one for None; all stopped (all at once too:
    each stop waits for its processes to exit), and the model removed, on the way out
    (also when one of them failed to start)."""
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-model-"))
    try:
        model_dir = None
        if model is not None:
            save_model(model, tmp / "model", seed)
            model_dir = str(tmp / "model")
        with contextlib.ExitStack() as stack:
            running: list[contextlib.AbstractContextManager[Started]] = []
            stack.callback(_exit_all, running)  # last on the way out: after the clients are closed
            with ThreadPoolExecutor(max_workers=len(configs), thread_name_prefix="cluster-start") as pool:
                futures = {name: pool.submit(_enter, local_cluster(replace(cfg, model=model_dir)))
                           for name, cfg in configs.items()}
            started, failure = {}, None
            for name, future in futures.items():
                try:
                    cm, started[name] = future.result()
                except BaseException as e:  # the others are stopped on the way out, then this is raised
                    failure = failure or e
                    continue
                running.append(cm)
            if failure is not None:
                raise failure
            yield {name: Up(s, stack.enter_context(Client(s.address, timeout=timeout))) for name, s in started.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _enter(cm: contextlib.AbstractContextManager[Started]) -> tuple[contextlib.AbstractContextManager[Started], Started]:
    return cm, cm.__enter__()


def _exit_all(cms: list[contextlib.AbstractContextManager[Started]]) -> None:
    """Leave every context at once; the first error, if any, once all have been left."""
    if not cms:
        return
    with ThreadPoolExecutor(max_workers=len(cms), thread_name_prefix="cluster-stop") as pool:
        futures = [pool.submit(cm.__exit__, None, None, None) for cm in cms]
    for future in futures:
        future.result()


def say(line: str) -> None:
    print(line, flush=True)


def print_log_tails(logs: Path, lines: int = 20) -> None:
    for path in sorted(logs.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {path.name} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr)

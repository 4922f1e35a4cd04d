"""The KV transfer part of the quantization benchmark (bench/quant/schemes.py) through a real
1P+1D cluster: the KV bytes each prompt token ships from prefill to decode, and how
long the transfer takes, per KV dtype.

    per KV dtype (auto = the base dtype, fp8_e4m3, fp8_e5m2): a LocalCluster, as
      `pdserve up` starts it: a router, 1 prefill and 1 decode worker as processes, the
      launcher's defaults (ZeroMQ tcp KV connector with CURVE keys, cluster token,
      prefix caching, 1 torch thread per worker), every worker with --kv-cache-dtype;
      the router with --local-prefill-threshold 0, so every prompt prefills remotely
      and its KV crosses; all clusters up at once, serving one saved checkpoint
    prompts: `cluster_prompts` of `transfer_prompt` tokens per repetition, seeded, the
      same for every dtype, fresh each repetition and in the warm-up (no prefix-cache hit)
    each repetition, every dtype in turn (bench/common/repeat.py): the prompts one at a time
      through the router's gRPC API, max_tokens 1, greedy; before and after, both
      workers' Stats (kv_transfer_bytes, kv_transfers) and the prefill worker's
      pdserve:kv_transfer_seconds histogram (its /metrics: sum and count)

What is reported per dtype, from the workers' own counters:
  bytes           page bytes the decode worker committed (Stats.kv_transfer_bytes),
                  checked equal to what the prefill worker sent and to the prompts'
                  whole blocks of every layer's K and V; per prompt token
  transfer tail   the prefill worker's kv_transfer_seconds: its final frame sent to
                  the decode worker's ack, per request (sum / count). The layer-wise
                  pages leave while the prefill's later layers compute, so this is
                  what the transfer adds after the prefill, not the time of every byte
  TTFT            the router's ttft_seconds (arrival at the router to the first
                  token, which comes back through the decode worker): the prefill,
                  the transfer and the hops, all of it
  prefill         the prefill worker's request_prefill_time_seconds (scheduled to
                  first token; the layer-wise sends happen inside it)
  rest            TTFT - prefill: the router, gRPC, the transfer's tail, the decode
                  worker's commit, the first token's way back
Each a mean over the repetition's requests; the report gives the median over the
repetitions [min, max], and each dtype's ratio to auto per repetition.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.common.random_model import FIRST_REGULAR_TOKEN
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import Client, collect

if TYPE_CHECKING:  # torch: only when the clusters start
    from pdserve.bench.quant.config import QuantBenchConfig
    from pdserve.launch.local import LocalCluster

KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Counters:
    """A cluster's KV transfer counters at one moment."""

    sent: int  # prefill worker: page bytes sent
    received: int  # decode worker: page bytes committed
    transfers: tuple[int, int]  # acknowledged (prefill), committed (decode)
    tail: tuple[float, int]  # prefill worker's kv_transfer_seconds histogram: sum, count
    prefill: tuple[float, int]  # its request_prefill_time_seconds: sum, count


@dataclass(frozen=True)
class Pass:
    """One dtype's repetition: the prompts' bytes and times."""

    tokens: int  # prompt tokens sent
    received: int  # KV page bytes the decode worker committed
    tail_s: float  # mean kv_transfer_seconds per request
    prefill_s: float  # mean request_prefill_time_seconds per request
    ttft_s: float  # mean TTFT

    @property
    def rest_s(self) -> float:
        """TTFT less the prefill worker's prefill: the router, gRPC, the transfer's
        tail, the decode worker's commit and the first token's way back."""
        return self.ttft_s - self.prefill_s

    @property
    def bytes_per_token(self) -> float:
        return self.received / self.tokens


@dataclass
class ClusterReport:
    passes: dict[str, list[Pass]] = field(default_factory=dict)  # KV dtype -> per repetition

    def bytes(self, kv: str) -> int:
        """Page bytes one repetition's prompts shipped (the same every repetition: checked)."""
        return self.passes[kv][0].received


class QuantCluster:
    """One dtype's 1P+1D cluster, a client of its router, its workers' counters."""

    def __init__(self, cluster: LocalCluster, kv_cache_dtype: str) -> None:
        self.cluster = cluster
        self.kv_cache_dtype = kv_cache_dtype
        workers = {w.role: w for w in cluster.live_workers()}
        self.prefill, self.decode = workers[pb.ROLE_PREFILL], workers[pb.ROLE_DECODE]
        self.client = Client(cluster.address, timeout=TIMEOUT_S)

    def stats(self, worker: pb.WorkerInfo) -> pb.StatsResponse:
        with self.cluster.channel(worker.address) as channel:  # internal: the launch's credentials
            return pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=30)

    def counters(self) -> Counters:
        sent, received = self.stats(self.prefill), self.stats(self.decode)
        tail, prefill = histograms(self.prefill, "kv_transfer_seconds", "request_prefill_time_seconds")
        return Counters(sent.kv_transfer_bytes, received.kv_transfer_bytes,
                        (sent.kv_transfers, received.kv_transfers), tail, prefill)

    def send(self, prompt: list[int]) -> float:
        """Send one prompt (one output token); the router's TTFT in seconds."""
        sequences = collect(self.client.generate(prompt, max_tokens=1, temperature=0.0, ignore_eos=True))
        (seq,) = sequences.values()
        if seq.usage.completion_tokens != 1:
            raise RuntimeError(f"{self.kv_cache_dtype}: {seq.usage.completion_tokens} tokens back, 1 asked "
                               f"({seq.finish_reason})")
        return seq.timing.ttft_seconds

    def close(self) -> None:
        self.client.close()


def histograms(worker: pb.WorkerInfo, *names: str) -> list[tuple[float, int]]:
    """(sum, count) of each of a worker's pdserve:<name> histograms, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    host = worker.address.rsplit(":", 1)[0]
    with urllib.request.urlopen(f"http://{host}:{worker.metrics_port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    wanted = {f"pdserve:{name}_{part}" for name in names for part in ("sum", "count")}
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name in wanted}
    if len(values) != len(wanted):
        raise RuntimeError(f"{worker.worker_id}: {sorted(wanted - set(values))} missing at its /metrics")
    return [(values[f"pdserve:{name}_sum"], int(values[f"pdserve:{name}_count"])) for name in names]


def make_prompts(cfg: QuantBenchConfig, rep: int) -> list[list[int]]:
    """Repetition `rep`'s prompts (rep -1: the warm-up's), each starting with its own
    token: no block of one is in another's prefix."""
    span = cfg.model.vocab_size - FIRST_REGULAR_TOKEN
    prompts = []
    for i in range(cfg.cluster_prompts):
        key = (rep + 1) * cfg.cluster_prompts + i
        prompts.append([FIRST_REGULAR_TOKEN + (key * 7919 + 31 * j * (key + 3)) % span
                        for j in range(cfg.transfer_prompt)])
    return prompts


def expected_bytes(cfg: QuantBenchConfig, kv: str, tokens: int) -> int:
    """Every layer's K and V pages of a `tokens`-token prompt's blocks."""
    import torch

    from pdserve.engine.quant.config import kv_torch_dtype

    elem = torch.empty((), dtype=kv_torch_dtype(kv, getattr(torch, cfg.dtype))).element_size()
    blocks = -(-tokens // cfg.block_size)
    return blocks * cfg.block_size * cfg.model.num_layers * 2 * cfg.model.kv_size * elem


def spec_for(model_dir: Path, kv: str, cfg: QuantBenchConfig):
    from pdserve.launch.local import ClusterSpec, LaunchConfig
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.worker.config import WorkerConfig

    blocks = -(-cfg.transfer_prompt // cfg.block_size) + 1
    return ClusterSpec(
        RouterConfig(model=str(model_dir), port=0, local_prefill_threshold=0, log_level="WARNING"),
        WorkerConfig(model=str(model_dir), kv_cache_dtype=kv, num_blocks=4 * blocks, block_size=cfg.block_size,
                     max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.transfer_prompt),
                     device=cfg.device, dtype=cfg.dtype, log_level="WARNING"),  # KV connector: the launcher's default
        LaunchConfig(prefill=1, decode=1),
    )


@contextmanager
def clusters(model_dir: Path, cfg: QuantBenchConfig) -> Iterator[dict[str, QuantCluster]]:
    """One cluster per KV dtype, started together (most of a start is imports and
    registration), stopped together on the way out; log tails printed if one fails."""
    from pdserve.bench.cluster.clusters import print_log_tails
    from pdserve.launch.local import LocalCluster, StartupError

    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-bench-quant-")))
        started: dict[str, LocalCluster] = {}

        def stop_all() -> None:
            with ThreadPoolExecutor(len(started) or 1) as pool:
                list(pool.map(LocalCluster.stop, started.values()))

        stack.callback(stop_all)

        def start(kv: str) -> None:
            (logs / kv).mkdir()
            cluster = LocalCluster(spec_for(model_dir, kv, cfg), log_dir=str(logs / kv))
            cluster.start()  # stops what it started before raising
            started[kv] = cluster

        with ThreadPoolExecutor(len(KV_DTYPES)) as pool:
            futures = [pool.submit(start, kv) for kv in KV_DTYPES]
        try:
            for f in futures:
                f.result()
        except StartupError:
            for kv in KV_DTYPES:
                print_log_tails(logs / kv)
            raise
        ups = {kv: QuantCluster(started[kv], kv) for kv in KV_DTYPES}
        for up in ups.values():
            stack.callback(up.close)
        yield ups


def measure(up: QuantCluster, prompts: list[list[int]], cfg: QuantBenchConfig) -> Pass:
    """The prompts one at a time; the counters' differences, checked."""
    before = up.counters()
    ttfts = [up.send(p) for p in prompts]
    after = wait_settled(up, before, len(prompts))
    tokens = sum(len(p) for p in prompts)
    sent, received = after.sent - before.sent, after.received - before.received
    expected = sum(expected_bytes(cfg, up.kv_cache_dtype, len(p)) for p in prompts)
    if not sent == received == expected:
        raise RuntimeError(f"{up.kv_cache_dtype}: prefill sent {sent} bytes, decode committed {received}, "
                           f"the prompts' pages are {expected}")
    tail, prefill = (mean_since(getattr(before, h), getattr(after, h)) for h in ("tail", "prefill"))
    return Pass(tokens, received, tail, prefill, statistics.mean(ttfts))


def mean_since(before: tuple[float, int], after: tuple[float, int]) -> float:
    """A histogram's mean over the observations between two scrapes."""
    return (after[0] - before[0]) / (after[1] - before[1])


def wait_settled(up: QuantCluster, before: Counters, requests: int) -> Counters:
    """The counters once both workers have counted every request's transfer (the
    prefill worker counts the ack on its next loop iteration, maybe after the reply)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        now = up.counters()
        done = (now.transfers[0] - before.transfers[0], now.transfers[1] - before.transfers[1],
                now.tail[1] - before.tail[1], now.prefill[1] - before.prefill[1])
        if done == (requests,) * 4:
            return now
        if any(d > requests for d in done) or time.monotonic() > deadline:
            raise RuntimeError(f"{up.kv_cache_dtype}: {requests} requests; counted (transfers by prefill, by "
                               f"decode, transfer times, prefill times) {done}")
        time.sleep(0.05)


def run(model_dir: Path, cfg: QuantBenchConfig, log: Callable[[str], None]) -> ClusterReport:
    report = ClusterReport()
    with clusters(model_dir, cfg) as ups:
        for kv, up in ups.items():  # connections, first forward passes, first landings
            measure(up, make_prompts(cfg, -1), cfg)

        def system(kv: str) -> Callable[[int], Pass]:
            def once(rep: int) -> Pass:
                result = measure(ups[kv], make_prompts(cfg, rep), cfg)
                log(f"  {kv}: {result.bytes_per_token:.1f} bytes/prompt token, transfer tail "
                    f"{1e3 * result.tail_s:.2f} ms, TTFT {1e3 * result.ttft_s:.1f} ms = prefill "
                    f"{1e3 * result.prefill_s:.1f} + rest {1e3 * result.rest_s:.1f}")
                return result
            return once

        report.passes = interleaved({kv: system(kv) for kv in KV_DTYPES}, cfg.repeats, log)
    print_report(report, cfg, log)
    return report


def print_report(report: ClusterReport, cfg: QuantBenchConfig, log: Callable[[str], None]) -> None:
    log(f"\nKV transfer through a 1P+1D cluster (router + prefill + decode worker processes, ZeroMQ tcp with CURVE): "
        f"{cfg.cluster_prompts} prompts of {cfg.transfer_prompt} tokens per repetition, one at a time, max_tokens 1; "
        f"{cfg.repeats} repetitions [min, max] of the per-request means; bytes: the decode worker's Stats; tail: the "
        f"prefill worker's kv_transfer_seconds (final frame -> ack); TTFT: the router's = the prefill worker's "
        f"request_prefill_time + rest")
    base = report.passes["auto"]
    for kv in KV_DTYPES:
        passes = report.passes[kv]
        if len({p.received for p in passes}) != 1:
            raise RuntimeError(f"{kv}: bytes differ between repetitions: {[p.received for p in passes]}")
        log(f"{kv:<9} {passes[0].received:>11} bytes  {passes[0].bytes_per_token:>9.1f} bytes/prompt token  "
            f"(auto / this {report.bytes('auto') / report.bytes(kv):.3f})")
        for name, attr in (("transfer tail", "tail_s"), ("TTFT", "ttft_s"), ("prefill", "prefill_s"),
                           ("rest", "rest_s")):
            ms = Ratio.of([1e3 * getattr(p, attr) for p in passes])
            vs = "" if kv == "auto" else \
                f"   auto / this {Ratio.paired([getattr(p, attr) for p in base], [getattr(p, attr) for p in passes])}"
            log(f"{'':<9} {name + ' ms':<16} {ms}{vs}")

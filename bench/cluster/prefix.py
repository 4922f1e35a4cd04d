"""What the prefix cache saves: TTFT with a long shared system prompt, through the cluster.

    python -m pdserve.bench.cluster.prefix            # about 6 minutes on 2 CPU cores
    python -m pdserve.bench.cluster.prefix --quick    # under a minute: the smoke test
    python -m pdserve.bench.cluster.prefix --gpu      # one GPU (bench/gpu_benchmarks.md)

Two comparisons, each between clusters that are all up before the first
measurement, repeated k times interleaved (A B A B ...; bench/common/repeat.py):

1. Prefix cache on vs off (1 prefill + 1 decode worker, KV over ZeroMQ tcp; the
   clusters differ only in the workers' --enable-prefix-caching). Every prompt is
   a system prompt shared by all requests of the repetition (`shared_fraction` of
   its tokens, 90 %) followed by a unique user part. Requests go one at a time
   (concurrency 1), so TTFT is the cost of the prompt, not queueing. Each
   repetition draws a new system prompt, so its first request is a cold miss in
   both clusters and counts like every other.
2. Across prefill workers (2 prefill + 1 decode, prefix cache on in every worker):
   the router's prefix-aware choice (`--prefill-policy prefix`, longest cached
   prefix by the block hashes each worker reports) against round robin. Requests
   use `cross_prefixes` different system prompts, in random order, and each
   prefill worker's KV pool holds only about `cross_capacity` of them: spread
   round robin, every worker sees every prompt and its LRU cache keeps evicting
   them; steered by prefix, each prompt stays on one worker. A few requests at the
   start of each repetition are also cold misses for both.

TTFT here is the client's: sending the request -> the first token. The ratios are
of mean TTFT (every request, cold misses included). The last line is
`ttft_ratio=X`: mean TTFT with the cache off over mean TTFT with it on (median over
repetitions); the prefix-aware / round-robin ratio is printed on the line before.
"""

from __future__ import annotations

import math
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from pdserve.bench.common.entry import ReportFlags, compare_entry, overridden
from pdserve.bench.serving.backend import Backend, GrpcBackend
from pdserve.bench.cluster.clusters import GPU_MODEL, ClusterConfig, ModelShape, clusters_up, say
from pdserve.bench.serving.metrics import Slo
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio
from pdserve.bench.serving.run import Measured, measure, warm_up, write_json
from pdserve.bench.serving.workloads import BenchRequest, random_ids
from pdserve.services.common.flags import flag


@dataclass(frozen=True)
class PrefixConfig:
    model: ModelShape | None = ModelShape()
    prompt_tokens: int = 1024
    shared_fraction: float = 0.9
    output_tokens: int = 4
    num_requests: int = 24  # per repetition, comparison 1
    cross_requests: int = 32  # per repetition, comparison 2
    cross_prefixes: int = 6
    cross_capacity: float = 3.5  # system prompts a prefill worker's pool holds
    block_size: int = 16
    num_blocks: int = 1024  # comparison 1, per worker
    repeats: int = 3
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.shared_fraction < 1:
            raise ValueError(f"shared_fraction: must be in (0, 1), got {self.shared_fraction}")
        if self.repeats < 1 or self.num_requests < 1 or self.cross_requests < 1 or self.cross_prefixes < 1:
            raise ValueError("repeats, num_requests, cross_requests and cross_prefixes must be >= 1")

    @property
    def shared_tokens(self) -> int:
        return round(self.prompt_tokens * self.shared_fraction)

    @property
    def cross_num_blocks(self) -> int:
        """Per worker in comparison 2: `cross_capacity` system prompts plus room for
        the request being served."""
        per_prompt = math.ceil(self.shared_tokens / self.block_size)
        return math.ceil(self.cross_capacity * per_prompt) + 2 * math.ceil(
            (self.prompt_tokens + self.output_tokens) / self.block_size)


QUICK = PrefixConfig(model=None, prompt_tokens=640, num_requests=8, cross_requests=10, cross_prefixes=3,
                     cross_capacity=2.5, num_blocks=256, repeats=2)
GPU = PrefixConfig(model=GPU_MODEL, prompt_tokens=6144, num_requests=32, cross_requests=48, num_blocks=8192, device="cuda",
                   dtype="bfloat16")


# -- workloads ---------------------------------------------------------------------------


def shared_prompt_requests(cfg: PrefixConfig, vocab: int, count: int, prefixes: int, tag: str) -> list[BenchRequest]:
    """`count` prompts: one of `prefixes` system prompts (chosen at random) + a unique
    part; all sent back to back (the load generator runs them one at a time)."""
    rng = random.Random(f"prefix-{cfg.seed}-{tag}")
    systems = [random_ids(cfg.shared_tokens, vocab, rng) for _ in range(prefixes)]
    unique = cfg.prompt_tokens - cfg.shared_tokens
    return [BenchRequest(i, systems[rng.randrange(prefixes)] + random_ids(unique, vocab, rng), cfg.output_tokens, 0.0)
            for i in range(count)]


def clusters(cfg: PrefixConfig) -> dict[str, ClusterConfig]:
    common = ClusterConfig(num_blocks=cfg.num_blocks, torch_threads=1, device=cfg.device,
                           dtype=cfg.dtype)
    cross = replace(common, prefill=2, num_blocks=cfg.cross_num_blocks)
    return {
        "cache on": common,
        "cache off": replace(common, enable_prefix_caching=False),
        "prefix-aware": replace(cross, prefill_policy="prefix"),
        "round-robin": replace(cross, prefill_policy="round_robin"),
    }


# -- the run ---------------------------------------------------------------------------------


def line(run: Measured) -> str:
    s = run.summary
    return (f"{run.label:<13} {s.completed}/{s.num_requests} ok  TTFT mean {s.ttft.mean:7.1f}  p50 {s.ttft.p50:7.1f}  "
            f"p99 {s.ttft.p99:7.1f} ms  cached prompt tokens {s.cached_tokens}/{s.input_tokens}  "
            f"load {run.load_avg[0]:.2f}")


def run(cfg: PrefixConfig, log: Callable[[str], None] = say, json_path: str | None = None,
        plot_path: str | None = None) -> tuple[str, list[str]]:
    with clusters_up(clusters(cfg), cfg.model, cfg.seed, cfg.timeout) as up:
        return _measure_all(cfg, {name: GrpcBackend(u.client) for name, u in up.items()}, log, json_path, plot_path)


def _measure_all(cfg: PrefixConfig, clients: dict[str, Backend], log: Callable[[str], None],
                 json_path: str | None, plot_path: str | None) -> tuple[str, list[str]]:
    info = clients["cache on"].served()
    log(f"model: {info.name} (vocab {info.vocab_size}); device {cfg.device} {cfg.dtype}; 1 torch thread per worker")
    log(f"prompts: {cfg.prompt_tokens} tokens = {cfg.shared_tokens} shared ({cfg.shared_fraction:.0%}) + "
        f"{cfg.prompt_tokens - cfg.shared_tokens} unique, {cfg.output_tokens} output tokens, one request at a time")
    log(f"1. cache on vs off: 1 prefill + 1 decode worker, {cfg.num_blocks} KV blocks each, {cfg.num_requests} "
        "requests per repetition sharing one system prompt")
    log(f"2. prefix-aware vs round-robin: 2 prefill + 1 decode worker, {cfg.cross_num_blocks} KV blocks each "
        f"(~{cfg.cross_capacity:g} system prompts), {cfg.cross_requests} requests over {cfg.cross_prefixes} system prompts")
    log(f"{cfg.repeats} repetitions, interleaved; load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for client in clients.values():
        warm_up(client, 2, cfg.timeout, info.vocab_size)

    def system(name: str, count: int, prefixes: int) -> Callable[[int], Measured]:
        def once(rep: int) -> Measured:
            requests = shared_prompt_requests(cfg, info.vocab_size, count, prefixes, f"{count}-{prefixes}-{rep}")
            result = measure(clients[name], requests, concurrency=1, timeout=cfg.timeout, slo=Slo(), label=name)
            log(f"[{rep + 1}/{cfg.repeats}] {line(result)}")
            return result

        return once

    one = (cfg.num_requests, 1)
    cross = (cfg.cross_requests, cfg.cross_prefixes)
    runs = interleaved({name: system(name, *(one if name.startswith("cache") else cross)) for name in clients},
                       cfg.repeats)
    mean = {name: [r.summary.ttft.mean for r in rs] for name, rs in runs.items()}
    cache = Ratio.paired(mean["cache off"], mean["cache on"])
    routing = Ratio.paired(mean["round-robin"], mean["prefix-aware"])
    log(f"mean TTFT cache off / cache on: {cache}")
    log(f"mean TTFT round-robin / prefix-aware (2 prefill workers): {routing}")
    problems = [f"{name} repetition {i + 1}: {p}" for name, rs in runs.items() for i, r in enumerate(rs)
                for p in r.problems()]
    problems += [f"{name} repetition {i + 1}: {r.summary.failed} failed" for name, rs in runs.items()
                 for i, r in enumerate(rs) if r.summary.failed]
    if json_path:
        write_json(json_path, {"config": asdict(cfg), "ttft_ratio": asdict(cache), "routing_ratio": asdict(routing),
                               "runs": {name: [r.to_dict() for r in rs] for name, rs in runs.items()}})
    if plot_path:
        from pdserve.bench.common.plot import Run, plot_runs

        last = cfg.repeats - 1
        plot_runs([Run(name, rs[last].start, rs[last].results) for name, rs in runs.items()], plot_path,
                  title=f"TTFT with a {cfg.shared_fraction:.0%} shared system prompt, repetition {last + 1}")
    return f"ttft_ratio={cache.median:.3f}", problems


@dataclass(frozen=True)
class PrefixFlags:
    """The command line; a flag left out keeps the preset's value."""

    quick: bool = flag(False, "embedded model, few requests, 2 repetitions (< 1 minute)")
    gpu: bool = flag(False, "GPU preset: ~1B-parameter model in bf16 on cuda")
    repeats: int | None = flag(None, "interleaved repetitions")
    num_requests: int | None = flag(None, "requests per repetition, cache on vs off")
    cross_requests: int | None = flag(None, "requests per repetition, prefix-aware vs round-robin")
    prompt_tokens: int | None = flag(None, "tokens per prompt")
    seed: int | None = flag(None, "seed of the prompts")
    report: ReportFlags = flag(ReportFlags(), "where the report is written")


def config_from(flags: PrefixFlags) -> PrefixConfig:
    return overridden(QUICK if flags.quick else GPU if flags.gpu else PrefixConfig(), flags)


def main(argv: Sequence[str] | None = None) -> int:
    return compare_entry("bench.cluster.prefix", PrefixFlags, argv, __doc__, config_from, run)


if __name__ == "__main__":
    sys.exit(main())

"""Does disaggregation pay? Colocated (2 mixed workers) against disaggregated (1
prefill + 1 decode worker) on the same machine, the same workload, in one run.

    python -m pdserve.bench.disagg             # about 8 minutes on 2 CPU cores
    python -m pdserve.bench.disagg --quick     # under a minute: the smoke test
    python -m pdserve.bench.disagg --gpu       # one GPU, both setups on it (scripts/gpu_benchmarks.md)

Both clusters are started before the first measurement and stay up: a router and
two worker processes each, every worker pinned to its own core (`--worker-cpus
0;1`: `os.sched_setaffinity` on every thread) with one torch thread, the same KV
pool, the same token budget per step (chunked prefill), the same model. They
differ only in how work is split:

    colocated      mixed-0 (core 0), mixed-1 (core 1): each prefills and decodes
                   the requests routed to it; a long prompt's prefill chunk shares
                   engine steps with every sequence decoding on that worker
    disaggregated  prefill-0 (core 0) prefills every prompt of at least
                   --local-prefill-threshold tokens and ships its KV over ZeroMQ tcp;
                   decode-0 (core 1) decodes everything (and prefills the short
                   prompts itself, as the router's conditional disaggregation says)

The router and this load generator are not pinned (the kernel runs them where there
is room; `--aux-cpus` pins both); the CPU seconds each process used are printed so
their share is visible.

Workload: the one disaggregation is for. A Poisson stream (`--request-rate`) of two
kinds of requests: chat-like ones (short prompts, long outputs) that keep many
sequences decoding, and, with probability `--long-fraction`, long prompts with
short outputs that arrive while they decode. Greedy, `ignore_eos`, exact lengths.
Each repetition draws a new workload (seed + repetition) and runs it on the
colocated cluster, then on the disaggregated one (A B A B ...), so load that
drifts over the run hits both; ratios are taken per repetition and reported as a
median with min-max (bench/repeat.py).

SLO (goodput: requests that met both bounds, per second of the run): `--slo`, or by
default TPOT <= 100 ms (DistServe's chatbot SLO: faster than anyone reads) and TTFT
<= 3x the unloaded TTFT of the longest prompt the workload can draw, measured on the
colocated cluster before the repetitions (median of 3), so the bound follows the
machine's speed instead of a number tuned to it. The header states the result.

The last line is `tpot_p99_ratio=X goodput_ratio=Y`: colocated TPOT p99 over
disaggregated TPOT p99, and disaggregated goodput over colocated goodput (medians
over repetitions).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from pdserve.bench.cluster import GPU_MODEL, ClusterConfig, ModelShape, Started, clusters_up, pin_process, say
from pdserve.bench.metrics import Slo
from pdserve.bench.repeat import Ratio, interleaved
from pdserve.bench.serving import Measured, interrupt_on_sigterm, measure, served_model, table, warm_up, write_json
from pdserve.bench.workloads import ArrivalConfig, BenchRequest, random_ids, send_times
from pdserve.services.router.client import Client

SYSTEMS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class DisaggConfig:
    model: ModelShape | None = ModelShape()
    num_requests: int = 140
    request_rate: float = 3.5  # req/s, Poisson
    long_fraction: float = 0.15
    long_prompt: tuple[int, int] = (1536, 1920)
    long_output: tuple[int, int] = (8, 16)
    short_prompt: tuple[int, int] = (16, 48)
    short_output: tuple[int, int] = (32, 64)
    slo: Slo | None = None  # None: TPOT <= 100 ms, TTFT <= 3x the longest prompt's unloaded TTFT
    repeats: int = 3
    seed: int = 0
    num_blocks: int = 2048
    max_num_batched_tokens: int = 2048
    worker_cpus: str = "0;1"
    aux_cpus: str = ""  # router + load generator; '': not pinned
    device: str = "cpu"
    dtype: str = "float32"
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.num_requests < 1 or not self.request_rate > 0:
            raise ValueError("--repeats, --num-requests and --request-rate must be positive")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"--long-fraction: must be in [0, 1], got {self.long_fraction}")


QUICK = DisaggConfig(model=None, num_requests=16, request_rate=8.0, long_fraction=0.25, long_prompt=(384, 512),
                     long_output=(4, 8), short_prompt=(8, 32), short_output=(16, 24), repeats=2, num_blocks=512)
GPU = DisaggConfig(model=GPU_MODEL, num_requests=400, request_rate=12.0, long_fraction=0.2, long_prompt=(4096, 6144),
                   short_prompt=(32, 128), short_output=(128, 256), num_blocks=16384, max_num_batched_tokens=8192,
                   worker_cpus="", device="cuda", dtype="bfloat16")


# -- workload --------------------------------------------------------------------------


def make_requests(cfg: DisaggConfig, vocab_size: int, rep: int) -> list[BenchRequest]:
    """Short-prompt/long-output and long-prompt/short-output requests, interleaved at
    random, Poisson arrivals; a function of (seed, repetition) only."""
    rng = random.Random(f"disagg-{cfg.seed}-{rep}")
    times = send_times(cfg.num_requests, ArrivalConfig(cfg.request_rate), random.Random(f"disagg-times-{cfg.seed}-{rep}"))
    requests = []
    for i, t in enumerate(times):
        long = rng.random() < cfg.long_fraction
        prompt_len = rng.randint(*(cfg.long_prompt if long else cfg.short_prompt))
        output = rng.randint(*(cfg.long_output if long else cfg.short_output))
        requests.append(BenchRequest(i, random_ids(prompt_len, vocab_size, rng), output, t))
    return requests


# -- clusters --------------------------------------------------------------------------


def cluster_configs(cfg: DisaggConfig) -> dict[str, ClusterConfig]:
    common = ClusterConfig(num_blocks=cfg.num_blocks, torch_threads=1, worker_cpus=cfg.worker_cpus,
                           max_num_batched_tokens=cfg.max_num_batched_tokens, device=cfg.device, dtype=cfg.dtype)
    return {
        "colocated": replace(common, prefill=0, decode=0, mixed=2),
        "disaggregated": replace(common, prefill=1, decode=1, mixed=0),
    }


def parse_cpus(text: str) -> set[int]:
    from pdserve.services.worker.config import parse_cpus as parse

    return parse(text)


# -- report ------------------------------------------------------------------------------


def one_line(run: Measured) -> str:
    s = run.summary
    return (f"{run.label:<14} done {s.completed}/{s.num_requests} in {s.duration_s:6.1f} s  "
            f"TTFT p50/p99 {s.ttft.p50:7.0f}/{s.ttft.p99:7.0f} ms  TPOT p50/p99 {s.tpot.p50:6.1f}/{s.tpot.p99:6.1f} ms  "
            f"ITL p99 {s.itl.p99:6.0f} ms  goodput {s.goodput:.2f} req/s ({s.good}/{s.completed})  "
            f"load {run.load_avg[0]:.2f}")


def median_rep(ratios: Sequence[float]) -> int:
    """The repetition whose ratio is the median (the lower middle one for even k)."""
    order = sorted(range(len(ratios)), key=lambda i: (math.isnan(ratios[i]), ratios[i]))
    return order[(len(order) - 1) // 2]


TPOT_SLO_MS = 100.0
TTFT_SLO_FACTOR = 3.0


def describe(cfg: DisaggConfig, model: str, slo: Slo) -> list[str]:
    return [
        f"model: {model}; device {cfg.device} {cfg.dtype}; per worker: 1 torch thread, {cfg.num_blocks} KV blocks, "
        f"{cfg.max_num_batched_tokens} tokens per step (chunked prefill); worker CPUs '{cfg.worker_cpus or 'unpinned'}', "
        f"router + load generator CPUs '{cfg.aux_cpus or 'unpinned'}'",
        f"workload: {cfg.num_requests} requests, Poisson {cfg.request_rate:g} req/s; {1 - cfg.long_fraction:.0%} "
        f"chat-like ({cfg.short_prompt[0]}-{cfg.short_prompt[1]} prompt, {cfg.short_output[0]}-{cfg.short_output[1]} "
        f"output tokens), {cfg.long_fraction:.0%} long prompts ({cfg.long_prompt[0]}-{cfg.long_prompt[1]} prompt, "
        f"{cfg.long_output[0]}-{cfg.long_output[1]} output tokens); greedy, ignore_eos; seed {cfg.seed} + repetition",
        f"SLO for goodput: {slo}; {cfg.repeats} repetitions, interleaved (colocated, disaggregated, ...)",
    ]


# -- the run ---------------------------------------------------------------------------------


def run(cfg: DisaggConfig, log: Callable[[str], None] = say, json_path: str | None = None,
        plot_path: str | None = None) -> tuple[str, list[str]]:
    """Both clusters up, interleaved repetitions; (last line, inconsistencies)."""
    with clusters_up(cluster_configs(cfg), cfg.model, cfg.seed, cfg.timeout) as up:
        if cfg.aux_cpus:
            cpus = parse_cpus(cfg.aux_cpus)
            for u in up.values():
                pin_process(u.started.pids["router"], cpus)
            pin_process(os.getpid(), cpus)
        started = {name: u.started for name, u in up.items()}
        clients = {name: u.client for name, u in up.items()}
        return _measure_all(cfg, started, clients, log, json_path, plot_path)


def _measure_all(cfg: DisaggConfig, started: dict[str, Started], clients: dict[str, Client], log: Callable[[str], None],
                 json_path: str | None, plot_path: str | None) -> tuple[str, list[str]]:
    info = served_model(clients["colocated"])
    load_at_start = os.getloadavg()
    rng = random.Random(f"disagg-calibration-{cfg.seed}")  # a fresh prompt each time: no prefix cache hit
    alone: list[float] = []
    for name, client in clients.items():  # first forward passes, connections; then the unloaded TTFT
        warm_up(client, 2, cfg.timeout, info.vocab_size)
        for i in range(4 if name == "colocated" else 2):
            longest = BenchRequest(0, random_ids(cfg.long_prompt[1], info.vocab_size, rng), cfg.long_output[0], 0.0)
            run = measure(client, [longest], concurrency=0, timeout=cfg.timeout, slo=Slo(), progress=False)
            if i:  # the first long prefill of a worker also pays for its first large allocations
                alone.append(run.summary.ttft.p50)
    slo = cfg.slo or Slo(ttft_ms=round(TTFT_SLO_FACTOR * statistics.median(alone[:3])), tpot_ms=TPOT_SLO_MS)
    log(f"unloaded TTFT of the longest prompt ({cfg.long_prompt[1]} tokens): colocated "
        f"{', '.join(f'{t:.0f}' for t in alone[:3])} ms, disaggregated {alone[3]:.0f} ms")
    for line in describe(cfg, f"{info.name} (vocab {info.vocab_size}, max_model_len {info.max_model_len})", slo):
        log(line)
    log(f"load average at start: {' '.join(f'{x:.2f}' for x in load_at_start)}")
    cpu_before = {name: s.cpu_seconds() for name, s in started.items()}
    me_before = time.process_time()

    def system(name: str) -> Callable[[int], Measured]:
        def once(rep: int) -> Measured:
            requests = make_requests(cfg, info.vocab_size, rep)
            result = measure(clients[name], requests, concurrency=0, timeout=cfg.timeout, slo=slo, label=name)
            log(f"[{rep + 1}/{cfg.repeats}] {one_line(result)}")
            return result

        return once

    runs = interleaved({name: system(name) for name in SYSTEMS}, cfg.repeats)
    colo, dis = runs["colocated"], runs["disaggregated"]
    tpot = Ratio.paired([r.summary.tpot.p99 for r in colo], [r.summary.tpot.p99 for r in dis])
    goodput = Ratio.paired([r.summary.goodput for r in dis], [r.summary.goodput for r in colo])
    pick = median_rep([c.summary.tpot.p99 / d.summary.tpot.p99 for c, d in zip(colo, dis)])
    for name in SYSTEMS:
        log(table(runs[name][pick].summary, f"{name}, repetition {pick + 1} (the median TPOT p99 ratio)"))
    log("per repetition:    TPOT p99 colocated / disaggregated        goodput disaggregated / colocated")
    for i, (c, d) in enumerate(zip(colo, dis)):
        log(f"  {i + 1}:  {c.summary.tpot.p99:8.1f} / {d.summary.tpot.p99:8.1f} ms = "
            f"{c.summary.tpot.p99 / d.summary.tpot.p99:6.2f}      {d.summary.goodput:6.2f} / {c.summary.goodput:6.2f} req/s")
    log(f"tpot_p99_ratio (colocated / disaggregated): {tpot}")
    log(f"goodput_ratio (disaggregated / colocated): {goodput}")
    log(_cpu_report(started, cpu_before, time.process_time() - me_before))
    problems = [f"{r.label} repetition {i + 1}: {p}" for name in SYSTEMS for i, r in enumerate(runs[name])
                for p in r.problems()]
    if json_path:
        write_json(json_path, {"config": {**asdict(cfg), "slo": str(slo)},
                               "tpot_p99_ratio": asdict(tpot), "goodput_ratio": asdict(goodput),
                               "runs": {name: [r.to_dict() for r in runs[name]] for name in SYSTEMS}})
    if plot_path:
        from pdserve.bench.plot import Run, plot_runs

        plot_runs([Run(name, runs[name][pick].start, runs[name][pick].results) for name in SYSTEMS], plot_path,
                  title=f"colocated vs disaggregated, repetition {pick + 1} of {cfg.repeats}")
    return f"tpot_p99_ratio={tpot.median:.3f} goodput_ratio={goodput.median:.3f}", problems


def _cpu_report(started: dict[str, Started], before: dict[str, dict[str, float]], me: float) -> str:
    parts = []
    for name, s in started.items():
        used = s.cpu_seconds()
        parts.append(f"{name}: " + ", ".join(f"{p} {used[p] - before[name][p]:.0f}" for p in used))
    return "CPU seconds during the measured repetitions: " + "; ".join(parts) + f"; load generator {me:.0f}"


# -- command line -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> tuple[DisaggConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="embedded model, small workload, 2 repetitions (< 1 minute)")
    p.add_argument("--gpu", action="store_true", help="GPU preset: ~1B-parameter model in bf16 on cuda")
    p.add_argument("--repeats", type=int)
    p.add_argument("--num-requests", type=int)
    p.add_argument("--request-rate", type=float)
    p.add_argument("--long-fraction", type=float)
    p.add_argument("--slo", help="ttft:MS,tpot:MS")
    p.add_argument("--seed", type=int)
    p.add_argument("--worker-cpus", help="one CPU list per worker, ';'-separated ('' unpinned)")
    p.add_argument("--aux-cpus", help="pin the router and the load generator to these CPUs")
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--json", dest="json_path", metavar="FILE")
    p.add_argument("--plot", dest="plot_path", metavar="FILE.png")
    args = p.parse_args(argv)
    base = QUICK if args.quick else GPU if args.gpu else DisaggConfig()
    given = {"repeats": args.repeats, "num_requests": args.num_requests, "request_rate": args.request_rate,
             "long_fraction": args.long_fraction, "seed": args.seed, "worker_cpus": args.worker_cpus,
             "aux_cpus": args.aux_cpus, "max_num_batched_tokens": args.max_num_batched_tokens,
             "slo": Slo.parse(args.slo) if args.slo else None}
    try:
        cfg = replace(base, **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        p.error(str(e))
    return cfg, args


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    start = time.perf_counter()
    try:
        last, problems = run(cfg, json_path=args.json_path, plot_path=args.plot_path)
    except KeyboardInterrupt:
        print("bench.disagg: interrupted", file=sys.stderr)
        return 130
    for problem in problems:
        print(f"INCONSISTENT: {problem}")
    print(f"benchmark wall time: {time.perf_counter() - start:.0f} s")
    print(last, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

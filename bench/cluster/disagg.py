"""Does disaggregation pay? Colocated (2 mixed workers) against disaggregated (1
prefill + 1 decode worker) on the same machine, the same workload, in one run.

    python -m pdserve.bench.cluster.disagg             # 5-8 minutes on 2 CPU cores
    python -m pdserve.bench.cluster.disagg --quick     # under a minute: the smoke test
    python -m pdserve.bench.cluster.disagg --gpu       # one GPU, both setups on it (bench/gpu_benchmarks.md)

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

Workload: the one disaggregation is for. Two Poisson streams: chat-like requests
(short prompts, longer outputs) that keep many sequences decoding, and long prompts
with short outputs that arrive while they decode. Greedy, `ignore_eos`, exact
lengths. Each repetition draws a new workload (seed + repetition) over
`--duration` seconds of arrivals and runs it on the colocated cluster, then on the
disaggregated one (A B A B ...), so load that drifts over the run hits both; ratios
are taken per repetition and reported as a median with min-max (bench/common/repeat.py).

Rates: set from service times measured on this machine before the repetitions
(unless `--long-rate` / `--chat-rate` are given), so that both setups are loaded
but stable whatever the machine's speed:

    T_long   unloaded TTFT of the longest prompt the workload draws (colocated
             cluster, median of 3 after a warm-up prefill)
    C, TPOT_N  output tokens/s and TPOT of `--decoding` (32) chats started together
             on the disaggregated decode worker, nothing else running: what one
             core can decode when it does nothing else
    long prompts: prefill_load / T_long per second -> the one prefill worker is
             busy `--prefill-load` (70 %) of the time, each colocated worker half that
    chats: decode_load * C / mean output per second -> the one decode worker needs
             `--decode-load` (30 %) of its decode capacity for them, each colocated
             worker 15 % of its own, before prefills interfere

With 2 cores the split is 1 prefill : 1 decode worker, so the mix is chosen to match
it: the decode worker also prefills every chat, receives every long prompt's KV and
streams every token, and at 60 % / 50 % it ran near saturation while the prefill
worker idled (docs/benchmarks.md has that run too).

SLO (goodput: requests that met both bounds, per second of the run): `--slo`, or by
default relative to the same measurements: TTFT <= 3 x T_long (a first token may
wait behind two other long prompts) and TPOT <= TPOT_N (decoding may be as slow as
one core decoding `--decoding` sequences, about twice the batch the rates lead to).
Goodput ratios at other SLO scales are printed too: how far the result depends on
the SLO chosen is part of the result.

The last line is `tpot_p99_ratio=X goodput_ratio=Y`: colocated TPOT p99 over
disaggregated TPOT p99, and disaggregated goodput over colocated goodput (medians
over repetitions).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from pdserve.bench.common.entry import ReportFlags, compare_entry, overridden
from pdserve.bench.serving.backend import Backend, GrpcBackend
from pdserve.bench.cluster.clusters import GPU_MODEL, ClusterConfig, ModelShape, Started, clusters_up, pin_process, say
from pdserve.bench.serving.metrics import Slo, summarize
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, median
from pdserve.bench.serving.run import Measured, measure, table, warm_up, write_json
from pdserve.bench.serving.workloads import ArrivalConfig, BenchRequest, random_ids, send_times
from pdserve.services.common.flags import flag

SYSTEMS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class DisaggConfig:
    model: ModelShape | None = ModelShape()
    duration_s: float = 40.0  # of arrivals, per repetition and setup
    prefill_load: float = 0.7  # busy fraction of the disaggregated prefill worker (calibrated rates)
    decode_load: float = 0.3  # fraction of one core's decode capacity the chats need (calibrated rates)
    decoding: int = 32  # chats decoding together when the decode capacity is measured
    long_rate: float | None = None  # long prompts per second; None: calibrated
    chat_rate: float | None = None  # chats per second; None: calibrated
    long_prompt: tuple[int, int] = (1536, 1920)
    long_output: tuple[int, int] = (8, 16)
    short_prompt: tuple[int, int] = (16, 48)
    short_output: tuple[int, int] = (32, 64)
    slo: Slo | None = None  # None: TTFT <= 3 x T_long, TPOT <= TPOT_N
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
        if self.repeats < 1 or self.decoding < 1 or not self.duration_s > 0:
            raise ValueError("--repeats, --decoding and --duration must be positive")
        for name in ("prefill_load", "decode_load"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be in (0, 1), got {getattr(self, name)}")
        for name in ("long_rate", "chat_rate"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 0, got {value}")


QUICK = DisaggConfig(model=None, duration_s=3.0, long_prompt=(384, 512), long_output=(4, 8), short_prompt=(8, 32),
                     short_output=(16, 24), decoding=16, repeats=2, num_blocks=512)
GPU = DisaggConfig(model=GPU_MODEL, duration_s=30.0, long_prompt=(4096, 6144), short_prompt=(32, 128),
                   short_output=(128, 256), decoding=128, num_blocks=16384, max_num_batched_tokens=8192,
                   worker_cpus="", device="cuda", dtype="bfloat16")
TTFT_SLO_FACTOR = 3.0
TPOT_SLO_FACTOR = 1.0
SLO_SCALES = (0.5, 1.0, 1.5, 2.0, 3.0)


@dataclass(frozen=True)
class Load:
    long_rate: float  # req/s
    chat_rate: float
    t_long_ms: float = math.nan  # what the rates and the default SLO were derived from
    tpot_n_ms: float = math.nan
    decode_tok_s: float = math.nan

    @property
    def rate(self) -> float:
        return self.long_rate + self.chat_rate


# -- workload --------------------------------------------------------------------------


def make_requests(cfg: DisaggConfig, load: Load, vocab_size: int, rep: int) -> list[BenchRequest]:
    """Chats and long prompts, Poisson arrivals of the two rates over `duration_s`
    (one Poisson stream of the summed rate, each arrival a long prompt with
    probability long_rate / rate); a function of (seed, repetition, load) only."""
    rng = random.Random(f"disagg-{cfg.seed}-{rep}")
    count = max(1, round(load.rate * cfg.duration_s))
    times = send_times(count, ArrivalConfig(load.rate), random.Random(f"disagg-times-{cfg.seed}-{rep}"))
    requests = []
    for i, t in enumerate(times):
        long = rng.random() < load.long_rate / load.rate
        prompt_len = rng.randint(*(cfg.long_prompt if long else cfg.short_prompt))
        output = rng.randint(*(cfg.long_output if long else cfg.short_output))
        requests.append(BenchRequest(i, random_ids(prompt_len, vocab_size, rng), output, t))
    return requests


def calibrate(cfg: DisaggConfig, clients: dict[str, Backend], vocab: int, log: Callable[[str], None]) -> tuple[Load, Slo]:
    """Measure T_long and TPOT_N (module docstring), after warming both clusters up;
    derive the rates not given and the default SLO."""
    rng = random.Random(f"disagg-calibration-{cfg.seed}")  # fresh prompts: no prefix cache hit

    def alone(client: Backend, prompt_len: int, output: int, count: int = 1) -> Measured:
        requests = [BenchRequest(i, random_ids(prompt_len, vocab, rng), output, 0.0) for i in range(count)]
        return measure(client, requests, concurrency=0, timeout=cfg.timeout, slo=Slo(), progress=False)

    for client in clients.values():  # connections, first forward passes, first large allocations
        warm_up(client, 2, cfg.timeout, vocab)
        alone(client, cfg.long_prompt[1], cfg.long_output[0])
    t_long = [alone(clients["colocated"], cfg.long_prompt[1], cfg.long_output[0]).summary.ttft.p50 for _ in range(3)]
    batch = alone(clients["disaggregated"], cfg.short_prompt[1], cfg.short_output[1], count=cfg.decoding)
    t_ms, tpot_ms, capacity = median(t_long), batch.summary.tpot.p50, batch.summary.output_throughput
    mean_output = sum(cfg.short_output) / 2
    load = Load(
        long_rate=cfg.long_rate if cfg.long_rate is not None else cfg.prefill_load / (t_ms / 1e3),
        chat_rate=cfg.chat_rate if cfg.chat_rate is not None else cfg.decode_load * capacity / mean_output,
        t_long_ms=t_ms, tpot_n_ms=tpot_ms, decode_tok_s=capacity,
    )
    if not load.rate > 0:  # nan when a calibration request failed
        raise RuntimeError(f"calibration gave no usable rates: {load}")
    slo = cfg.slo or Slo(ttft_ms=round(TTFT_SLO_FACTOR * t_ms), tpot_ms=round(TPOT_SLO_FACTOR * tpot_ms, 1))
    log(f"calibration: T_long (TTFT of a lone {cfg.long_prompt[1]}-token prompt) "
        f"{', '.join(f'{t:.0f}' for t in t_long)} ms; {cfg.decoding} chats decoding together on one worker: "
        f"TPOT_N {tpot_ms:.1f} ms, C = {capacity:.0f} output tok/s")
    why_long = "given" if cfg.long_rate is not None else f"prefill worker {cfg.prefill_load:.0%} busy"
    why_chat = "given" if cfg.chat_rate is not None else f"{cfg.decode_load:.0%} of C"
    log(f"rates: long prompts {load.long_rate:.3f}/s ({why_long}), chats {load.chat_rate:.3f}/s ({why_chat}); "
        f"{round(load.rate * cfg.duration_s)} requests per repetition")
    return load, slo


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


def describe(cfg: DisaggConfig, model: str, load: Load, slo: Slo) -> list[str]:
    return [
        f"model: {model}; device {cfg.device} {cfg.dtype}; per worker: 1 torch thread, {cfg.num_blocks} KV blocks, "
        f"{cfg.max_num_batched_tokens} tokens per step (chunked prefill); worker CPUs '{cfg.worker_cpus or 'unpinned'}', "
        f"router + load generator CPUs '{cfg.aux_cpus or 'unpinned'}'",
        f"workload: {cfg.duration_s:g} s of Poisson arrivals at {load.rate:.2f} req/s: chats at {load.chat_rate:.2f}/s "
        f"({cfg.short_prompt[0]}-{cfg.short_prompt[1]} prompt, {cfg.short_output[0]}-{cfg.short_output[1]} output "
        f"tokens), long prompts at {load.long_rate:.2f}/s ({cfg.long_prompt[0]}-{cfg.long_prompt[1]} prompt, "
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
        clients = {name: GrpcBackend(u.client) for name, u in up.items()}
        return _measure_all(cfg, started, clients, log, json_path, plot_path)


def _measure_all(cfg: DisaggConfig, started: dict[str, Started], clients: dict[str, Backend], log: Callable[[str], None],
                 json_path: str | None, plot_path: str | None) -> tuple[str, list[str]]:
    info = clients["colocated"].served()
    load_at_start = os.getloadavg()
    load, slo = calibrate(cfg, clients, info.vocab_size, log)
    for line in describe(cfg, f"{info.name} (vocab {info.vocab_size}, max_model_len {info.max_model_len})", load, slo):
        log(line)
    log(f"load average at start: {' '.join(f'{x:.2f}' for x in load_at_start)}")
    cpu_before = {name: s.cpu_seconds() for name, s in started.items()}
    me_before = time.process_time()

    def system(name: str) -> Callable[[int], Measured]:
        def once(rep: int) -> Measured:
            requests = make_requests(cfg, load, info.vocab_size, rep)
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
    log("goodput ratio at other SLO scales (both bounds multiplied; 1 = the SLO above):")
    for scale in SLO_SCALES:
        scaled = Slo(slo.ttft_ms * scale if slo.ttft_ms else None, slo.tpot_ms * scale if slo.tpot_ms else None)
        good = {name: [summarize(r.start, r.results, scaled) for r in runs[name]] for name in SYSTEMS}
        ratio = Ratio.paired([g.goodput for g in good["disaggregated"]], [g.goodput for g in good["colocated"]])
        met = {name: sum(g.good for g in good[name]) / sum(g.completed for g in good[name]) for name in SYSTEMS}
        log(f"  x{scale:<4g} {scaled}: {ratio}; SLO met by {met['colocated']:.0%} colocated, "
            f"{met['disaggregated']:.0%} disaggregated")
    log(_cpu_report(started, cpu_before, time.process_time() - me_before))
    problems = [f"{r.label} repetition {i + 1}: {p}" for name in SYSTEMS for i, r in enumerate(runs[name])
                for p in r.problems()]
    if json_path:
        write_json(json_path, {"config": {**asdict(cfg), "slo": str(slo), "load": asdict(load)},
                               "tpot_p99_ratio": asdict(tpot), "goodput_ratio": asdict(goodput),
                               "runs": {name: [r.to_dict() for r in runs[name]] for name in SYSTEMS}})
    if plot_path:
        from pdserve.bench.common.plot import Run, plot_runs

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


@dataclass(frozen=True)
class DisaggFlags:
    """The command line; a flag left out keeps the preset's value."""

    quick: bool = flag(False, "embedded model, 3 s of arrivals, 2 repetitions (< 1 minute)")
    gpu: bool = flag(False, "GPU preset: ~1B-parameter model in bf16 on cuda")
    repeats: int | None = flag(None, "interleaved repetitions (3)")
    duration: float | None = flag(None, "seconds of arrivals per repetition (40)")
    prefill_load: float | None = flag(None, "calibrated rates: busy fraction of the prefill worker (0.7)")
    decode_load: float | None = flag(None, "calibrated rates: share of one core's decode capacity (0.3)")
    decoding: int | None = flag(None, "chats decoding together when the capacity is measured (32)")
    long_rate: float | None = flag(None, "long prompts per second (default: calibrated)")
    chat_rate: float | None = flag(None, "chats per second (default: calibrated)")
    slo: str | None = flag(None, "ttft:MS,tpot:MS (default: relative to the calibration)")
    seed: int | None = flag(None, "seed of the workload")
    worker_cpus: str | None = flag(None, "one CPU list per worker, ';'-separated ('' unpinned; 0;1)")
    aux_cpus: str | None = flag(None, "pin the router and the load generator to these CPUs")
    max_num_batched_tokens: int | None = flag(None, "every worker's token budget per step (2048)")
    report: ReportFlags = flag(ReportFlags(), "where the report is written")


def config_from(flags: DisaggFlags) -> DisaggConfig:
    base = QUICK if flags.quick else GPU if flags.gpu else DisaggConfig()
    cfg = overridden(base, flags, renamed={"duration": "duration_s"}, skip={"slo"})
    return replace(cfg, slo=Slo.parse(flags.slo)) if flags.slo else cfg


def main(argv: Sequence[str] | None = None) -> int:
    return compare_entry("bench.cluster.disagg", DisaggFlags, argv, __doc__, config_from, run)


if __name__ == "__main__":
    sys.exit(main())

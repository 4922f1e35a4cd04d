"""Online serving benchmark: latency and throughput of a pdserve cluster over gRPC.

    python -m pdserve.bench.serving --quick                     # starts its own cluster, < 1 minute
    python -m pdserve.bench.serving                             # 64 requests, 128 tokens each
    python -m pdserve.bench.serving --addr 127.0.0.1:50051 --request-rate 4 --concurrency 16

Without `--addr` a local cluster (`launch.local.LocalCluster`: router + workers as
processes, logs in a temporary directory) is started first and stopped at the end,
also on Ctrl-C, SIGTERM or an error; with `--addr` the benchmark targets a running
cluster (`pdserve up`) and imports neither torch nor the engine.

Workload (seeded, so two runs send the same requests at the same times):

* `--prompt-source text` (default): slices of random lengths (`--prompt-chars`) from
  the Python standard library's source, the domain of the embedded default model;
  the prompt token counts reported are the router's (`usage.prompt_tokens`).
* `--prompt-source random`: random token ids (`--prompt-tokens` long, exact lengths)
  sent as a `token_ids` prompt, drawn below the served model's vocabulary size.
* Every request is greedy with `max_tokens=--max-tokens` and `ignore_eos`, so each one
  generates exactly that many tokens; a request that ends otherwise is a failure.
* Arrivals: a Poisson process of `--request-rate` requests per second (exponential
  gaps), or all at once with `inf`; at most `--concurrency` requests in flight (0: no
  limit). Each request runs on its own thread (grpc channels are thread-safe) and has
  a deadline (`--timeout`), so the run always ends.
* `--num-warmup` short requests go first and are not measured.

Measured on the client, per request, with `time.perf_counter`:

* TTFT: sending the request -> the first message carrying a token;
* ITL: the gap between consecutive token-carrying messages (one entry per message;
  pdserve sends one message per engine step, i.e. one token, for n=1);
* TPOT: (e2e - TTFT) / (tokens - 1);
* e2e: sending the request -> the end of the stream.

Reported: p50/p90/p99 (linear interpolation) and mean of each in ms, request and
token throughput over the benchmark's duration (first request sent -> last request
done), and failed requests grouped by reason. The router's own TTFT/TPOT (the
`timing` of each last message) are shown next to the client's for comparison.

The exit status is 0 when every request succeeded, else 1. The last line printed is
`ttft_p50_ms=X tpot_p50_ms=Y` (client-side medians, `nan` when nothing succeeded).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import signal
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client

FIRST_REGULAR_TOKEN = 3  # random prompts avoid the low ids, where small vocabularies keep bos/eos/pad
WARMUP_PROMPT = "import os\n\n\ndef main():\n    "
WARMUP_TOKENS = 4
CONNECT_TIMEOUT = 30.0  # seconds for the router to answer ListModels
PERCENTILES = (50, 90, 99)


# -- configuration -------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 64
    max_tokens: int = 128
    prompt_source: str = "text"  # "text" | "random"
    prompt_chars: tuple[int, int] = (64, 1536)  # text: characters per prompt, inclusive, uniform
    prompt_tokens: tuple[int, int] = (16, 512)  # random: token ids per prompt, inclusive, uniform
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.num_requests >= 1, f"--num-requests must be >= 1, got {self.num_requests}")
        _require(self.max_tokens >= 1, f"--max-tokens must be >= 1, got {self.max_tokens}")
        _require(self.prompt_source in ("text", "random"), f"--prompt-source: text | random, got {self.prompt_source!r}")
        for name in ("prompt_chars", "prompt_tokens"):
            lo, hi = getattr(self, name)
            _require(1 <= lo <= hi, f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests per second, Poisson; inf: all at time 0
    concurrency: int = 0  # most requests in flight; 0: no limit
    timeout: float = 120.0  # deadline of every request, in seconds
    num_warmup: int = 1

    def __post_init__(self) -> None:
        _require(self.request_rate > 0, f"--request-rate must be > 0, got {self.request_rate}")
        _require(self.concurrency >= 0, f"--concurrency must be >= 0, got {self.concurrency}")
        _require(self.timeout > 0, f"--timeout must be > 0, got {self.timeout}")
        _require(self.num_warmup >= 0, f"--num-warmup must be >= 0, got {self.num_warmup}")


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster started when no --addr is given: `pdserve up`'s default topology,
    one prefill and one decode worker with the KV transfer between them."""

    prefill: int = 1
    decode: int = 1
    mixed: int = 0
    num_blocks: int | None = None
    torch_threads: int = 1
    kv_connector: str | None = None  # None: the launcher's default (ZeroMQ tcp); "": none
    startup_timeout: float = 180.0
    metrics: bool = True  # Prometheus metrics in every service (--no-metrics: off, to measure their cost)


@dataclass(frozen=True)
class BenchConfig:
    workload: WorkloadConfig = WorkloadConfig()
    load: LoadConfig = LoadConfig()
    cluster: ClusterConfig = ClusterConfig()
    addr: str | None = None  # None: start a local cluster


QUICK_WORKLOAD = WorkloadConfig(num_requests=16, max_tokens=16, prompt_chars=(32, 512), prompt_tokens=(8, 128))


# -- workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str | tuple[int, ...]
    max_tokens: int
    send_at: float  # seconds after the benchmark's start


def stdlib_corpus(min_chars: int, rng: random.Random) -> str:
    """At least `min_chars` characters of standard-library source, from files in a
    seeded order (the same text for the same seed and Python version)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng.shuffle(files)
    parts: list[str] = []
    size = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= min_chars:
            break
    corpus = "\n".join(parts)
    _require(len(corpus) >= min_chars, f"standard library source: only {len(corpus)} characters")
    return corpus


def text_prompts(cfg: WorkloadConfig, rng: random.Random) -> list[str]:
    corpus = stdlib_corpus(max(1 << 20, 4 * cfg.prompt_chars[1]), rng)
    prompts = []
    for _ in range(cfg.num_requests):
        length = rng.randint(*cfg.prompt_chars)
        start = rng.randrange(len(corpus) - length + 1)
        prompts.append(corpus[start : start + length])
    return prompts


def random_prompts(cfg: WorkloadConfig, vocab_size: int, rng: random.Random) -> list[tuple[int, ...]]:
    _require(vocab_size > FIRST_REGULAR_TOKEN, f"served vocabulary too small: {vocab_size}")
    return [
        tuple(rng.randrange(FIRST_REGULAR_TOKEN, vocab_size) for _ in range(rng.randint(*cfg.prompt_tokens)))
        for _ in range(cfg.num_requests)
    ]


def send_times(num: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate; all zeros for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def make_workload(cfg: WorkloadConfig, rate: float, vocab_size: int) -> list[BenchRequest]:
    """Prompts and arrival times from separate seeded streams: changing the rate keeps the prompts."""
    prompt_rng = random.Random(f"prompts-{cfg.seed}")
    prompts: Sequence[str | tuple[int, ...]] = (
        text_prompts(cfg, prompt_rng) if cfg.prompt_source == "text" else random_prompts(cfg, vocab_size, prompt_rng)
    )
    times = send_times(cfg.num_requests, rate, random.Random(f"arrivals-{cfg.seed}"))
    return [BenchRequest(i, p, cfg.max_tokens, t) for i, (p, t) in enumerate(zip(prompts, times))]


# -- running requests ----------------------------------------------------------------


@dataclass(frozen=True)
class RequestResult:
    index: int
    error: str  # "" on success
    started: float  # perf_counter when sent
    finished: float  # perf_counter at the end of the stream (or the failure)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    itl: tuple[float, ...] = ()
    server_ttft: float = math.nan
    server_tpot: float = math.nan

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def e2e(self) -> float:
        return self.finished - self.started

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


class InFlight:
    """The calls running now, so that an interrupted benchmark can cancel them all;
    once closed, new calls are cancelled as they start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[grpc.Call] = set()
        self._closed = False

    def add(self, call: grpc.Call) -> bool:
        with self._lock:
            if not self._closed:
                self._calls.add(call)
                return True
        call.cancel()
        return False

    def discard(self, call: grpc.Call) -> None:
        with self._lock:
            self._calls.discard(call)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()


def run_request(client: Client, request: BenchRequest, timeout: float, inflight: InFlight) -> RequestResult:
    """One streamed Generate call, timed message by message; never raises for an RPC failure."""
    started = time.perf_counter()
    call = client.generate(request.prompt, max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True,
                           timeout=timeout)
    if not inflight.add(call):
        return RequestResult(request.index, "CANCELLED: benchmark interrupted", started, time.perf_counter())
    first: float | None = None
    last = started
    gaps: list[float] = []
    tokens = 0
    final: pb.GenerateResponse | None = None
    try:
        for message in call:
            now = time.perf_counter()
            if message.token_ids:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                tokens += len(message.token_ids)
            if message.finish_reason:
                final = message
    except grpc.RpcError as e:
        return RequestResult(request.index, f"{e.code().name}: {e.details()}", started, time.perf_counter(),
                             output_tokens=tokens)
    finally:
        inflight.discard(call)
    finished = time.perf_counter()
    problem = _incomplete(final, tokens, request.max_tokens)
    if problem or first is None or final is None:
        return RequestResult(request.index, problem or "no token", started, finished, output_tokens=tokens)
    return RequestResult(
        request.index, "", started, finished, prompt_tokens=final.usage.prompt_tokens, output_tokens=tokens,
        ttft=first - started, itl=tuple(gaps),
        server_ttft=final.timing.ttft_seconds, server_tpot=final.timing.tpot_seconds,
    )


def _incomplete(final: pb.GenerateResponse | None, tokens: int, expected: int) -> str:
    if final is None:
        return f"stream ended without a finish_reason after {tokens} tokens"
    if final.finish_reason != "length" or tokens != expected:
        return f"finish_reason={final.finish_reason!r} after {tokens}/{expected} tokens"
    return ""


def warm_up(client: Client, count: int, timeout: float) -> None:
    """A few short requests, not measured (first forward passes, connections)."""
    inflight = InFlight()
    for i in range(count):
        result = run_request(client, BenchRequest(-1 - i, WARMUP_PROMPT, WARMUP_TOKENS, 0.0), timeout, inflight)
        if not result.ok:
            print(f"warning: warm-up request failed: {result.error}", file=sys.stderr)


def run_workload(client: Client, requests: Sequence[BenchRequest], load: LoadConfig) -> tuple[float, list[RequestResult]]:
    """Send every request at its time, at most `load.concurrency` in flight; returns
    the start time (perf_counter) and the results in request order. On an interrupt
    every call in flight is cancelled before the exception propagates."""
    inflight = InFlight()
    with ThreadPoolExecutor(max_workers=load.concurrency or len(requests), thread_name_prefix="bench") as pool:
        try:
            start = time.perf_counter()
            futures = []
            for request in requests:
                delay = start + request.send_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(run_request, client, request, load.timeout, inflight))
            return start, [f.result() for f in futures]
        except BaseException:
            inflight.close()
            pool.shutdown(wait=False, cancel_futures=True)
            raise


# -- metrics -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    p50: float
    p90: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> "Distribution":
        ms = [v * 1e3 for v in values if not math.isnan(v)]
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(p50, p90, p99, sum(ms) / len(ms) if ms else math.nan, len(ms))


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    server_ttft: Distribution
    server_tpot: Distribution
    errors: tuple[tuple[str, int], ...]  # reason, count; most frequent first

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.duration_s if self.duration_s > 0 else math.nan


def summarize(start: float, results: Sequence[RequestResult]) -> Summary:
    ok = [r for r in results if r.ok]
    end = max((r.finished for r in results), default=start)
    return Summary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=end - start,
        input_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=sum(r.output_tokens for r in ok),
        ttft=Distribution.of_seconds([r.ttft for r in ok]),
        tpot=Distribution.of_seconds([r.tpot for r in ok]),
        itl=Distribution.of_seconds([gap for r in ok for gap in r.itl]),
        e2e=Distribution.of_seconds([r.e2e for r in ok]),
        server_ttft=Distribution.of_seconds([r.server_ttft for r in ok]),
        server_tpot=Distribution.of_seconds([r.server_tpot for r in ok if r.output_tokens > 1]),
        errors=tuple(Counter(r.error for r in results if not r.ok).most_common()),
    )


def report(summary: Summary, cfg: BenchConfig, target: str) -> str:
    w, load = cfg.workload, cfg.load
    concurrency = load.concurrency or "unlimited"
    lines = [
        f"target: {target}",
        f"workload: {w.num_requests} requests, {w.prompt_source} prompts "
        f"({_prompt_range(w)}), max_tokens={w.max_tokens}, ignore_eos, greedy, seed={w.seed}",
        f"load: request_rate={load.request_rate} req/s, concurrency={concurrency}, timeout={load.timeout:g}s, "
        f"warm-up={load.num_warmup}",
        "=" * 64,
        f"{'successful requests:':<36}{summary.completed}",
        f"{'failed requests:':<36}{summary.failed}",
        f"{'benchmark duration (s):':<36}{summary.duration_s:.2f}",
        f"{'total input tokens:':<36}{summary.input_tokens}",
        f"{'total output tokens:':<36}{summary.output_tokens}",
        f"{'request throughput (req/s):':<36}{summary.request_throughput:.2f}",
        f"{'output token throughput (tok/s):':<36}{summary.output_throughput:.2f}",
        f"{'total token throughput (tok/s):':<36}{summary.total_throughput:.2f}",
        "-" * 64,
        f"{'(ms)':<20}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'n':>6}",
    ]
    rows = (("TTFT", summary.ttft), ("TPOT", summary.tpot), ("ITL", summary.itl), ("E2E", summary.e2e),
            ("TTFT (router)", summary.server_ttft), ("TPOT (router)", summary.server_tpot))
    for name, d in rows:
        lines.append(f"{name:<20}{d.p50:>10.2f}{d.p90:>10.2f}{d.p99:>10.2f}{d.mean:>10.2f}{d.count:>6}")
    lines.append("=" * 64)
    lines += [f"error x{count}: {reason}" for reason, count in summary.errors]
    lines.append(f"ttft_p50_ms={summary.ttft.p50:.2f} tpot_p50_ms={summary.tpot.p50:.2f}")
    return "\n".join(lines)


def _prompt_range(w: WorkloadConfig) -> str:
    if w.prompt_source == "text":
        return f"{w.prompt_chars[0]}-{w.prompt_chars[1]} chars of stdlib source"
    return f"{w.prompt_tokens[0]}-{w.prompt_tokens[1]} random token ids"


# -- cluster -------------------------------------------------------------------------


@contextlib.contextmanager
def local_cluster(cfg: ClusterConfig) -> Iterator[str]:
    """A LocalCluster for the duration of the block; its address. The children's logs
    go to a temporary directory; their tails are printed if the cluster fails to start."""
    from pdserve.launch.local import ClusterSpec, LaunchConfig, LocalCluster, StartupError  # torch: only here
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.worker.config import WorkerConfig

    spec = ClusterSpec(
        RouterConfig(port=0, log_level="WARNING", metrics=cfg.metrics),
        WorkerConfig(num_blocks=cfg.num_blocks, torch_threads=cfg.torch_threads, kv_connector=cfg.kv_connector,
                     log_level="WARNING", metrics=cfg.metrics),
        LaunchConfig(prefill=cfg.prefill, decode=cfg.decode, mixed=cfg.mixed, startup_timeout=cfg.startup_timeout),
    )
    with tempfile.TemporaryDirectory(prefix="pdserve-serving-") as logs:
        cluster = LocalCluster(spec, log_dir=logs)
        try:
            address = cluster.start()  # stops what it started before raising
        except StartupError:
            _print_log_tails(Path(logs))
            raise
        try:
            yield address
        finally:
            cluster.stop()


def _print_log_tails(logs: Path, lines: int = 20) -> None:
    for path in sorted(logs.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {path.name} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr)


@contextlib.contextmanager
def target(cfg: BenchConfig) -> Iterator[str]:
    if cfg.addr:
        yield cfg.addr
    else:
        with local_cluster(cfg.cluster) as address:
            yield address


def served_model(client: Client) -> pb.ModelInfo:
    try:
        (model, *_) = client.list_models(timeout=CONNECT_TIMEOUT)
    except grpc.RpcError as e:
        raise ConnectionError(f"router at {client.address}: {e.code().name}: {e.details()}") from e
    except ValueError:
        raise ConnectionError(f"router at {client.address} serves no model") from None
    return model


def benchmark(cfg: BenchConfig) -> tuple[Summary, str]:
    """Run the whole benchmark (cluster included); the summary and a description of the target."""
    with target(cfg) as address, Client(address, timeout=cfg.load.timeout) as client:
        model = served_model(client)
        requests = make_workload(cfg.workload, cfg.load.request_rate, model.vocab_size)
        warm_up(client, cfg.load.num_warmup, cfg.load.timeout)
        start, results = run_workload(client, requests, cfg.load)
        where = "own local cluster" if cfg.addr is None else "running cluster"
        description = f"{address} ({where}), model {model.name}, max_model_len={model.max_model_len}"
    return summarize(start, results), description


# -- command line --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    w, load, c = WorkloadConfig(), LoadConfig(), ClusterConfig()
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--addr", help="router of a running cluster (default: start a local one)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_WORKLOAD.num_requests} requests of {QUICK_WORKLOAD.max_tokens} tokens, "
                             "shorter prompts (explicit flags still win)")
    parser.add_argument("--num-requests", type=int, help=f"default {w.num_requests}")
    parser.add_argument("--max-tokens", type=int, help=f"tokens generated per request (default {w.max_tokens})")
    parser.add_argument("--prompt-source", choices=("text", "random"), default=w.prompt_source)
    parser.add_argument("--prompt-chars", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help=f"text prompt length in characters (default {w.prompt_chars[0]} {w.prompt_chars[1]})")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help=f"random prompt length in tokens (default {w.prompt_tokens[0]} {w.prompt_tokens[1]})")
    parser.add_argument("--seed", type=int, default=w.seed)
    parser.add_argument("--request-rate", type=float, default=load.request_rate,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--concurrency", type=int, default=load.concurrency, help="most requests in flight (0: no limit)")
    parser.add_argument("--timeout", type=float, default=load.timeout, help="deadline of each request in seconds")
    parser.add_argument("--num-warmup", type=int, default=load.num_warmup, help="unmeasured requests sent first")
    own = parser.add_argument_group("own cluster (without --addr)")
    own.add_argument("--prefill", type=int, default=c.prefill)
    own.add_argument("--decode", type=int, default=c.decode)
    own.add_argument("--mixed", type=int, default=c.mixed)
    own.add_argument("--num-blocks", type=int, default=c.num_blocks, help="KV blocks per worker (default: sized by the worker)")
    own.add_argument("--torch-threads", type=int, default=c.torch_threads, help="per worker")
    own.add_argument("--kv-connector", default=c.kv_connector, help="workers' KV transfer connector 'module:factory' (default: ZeroMQ tcp; '' for none)")
    own.add_argument("--startup-timeout", type=float, default=c.startup_timeout)
    own.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=c.metrics,
                     help="Prometheus metrics in every service (--no-metrics: off)")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    base = QUICK_WORKLOAD if args.quick else WorkloadConfig()
    given = {
        "num_requests": args.num_requests, "max_tokens": args.max_tokens,
        "prompt_chars": tuple(args.prompt_chars) if args.prompt_chars else None,
        "prompt_tokens": tuple(args.prompt_tokens) if args.prompt_tokens else None,
    }
    workload = replace(base, prompt_source=args.prompt_source, seed=args.seed,
                       **{k: v for k, v in given.items() if v is not None})
    load = LoadConfig(args.request_rate, args.concurrency, args.timeout, args.num_warmup)
    cluster = ClusterConfig(args.prefill, args.decode, args.mixed, args.num_blocks, args.torch_threads,
                            args.kv_connector, args.startup_timeout, metrics=args.metrics)
    return BenchConfig(workload, load, cluster, args.addr)


def _interrupt_on_sigterm(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)  # unwind: the cluster is stopped on the way out
    try:
        summary, description = benchmark(cfg)
    except KeyboardInterrupt:
        print("bench.serving: interrupted", file=sys.stderr)
        return 130
    except (ConnectionError, RuntimeError, OSError, ValueError) as e:
        print(f"bench.serving: {e}", file=sys.stderr)
        return 1
    print(report(summary, cfg, description), flush=True)
    return 0 if summary.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

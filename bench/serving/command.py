"""`pdserve bench`: an open-loop load generator and latency report for any pdserve router.

    pdserve bench --quick                                  # own small cluster, < 1 minute
    pdserve bench --addr 127.0.0.1:50051 --request-rate 4 --burstiness 0.5 --slo ttft:500,tpot:50
    pdserve bench --workload prefix --prefix-count 4 --prefix-tokens 512 --json run.json --plot run.png
    pdserve bench --workload trace --dataset mooncake_trace.jsonl --trace-block-tokens 16
    pdserve bench --workload multiturn --num-requests 32 --turns 5 10 --think-time 1 --prompt-tokens 32 64
    pdserve bench --backend openai-chat --base-url http://127.0.0.1:8000/v1   # any OpenAI-compatible server
    (python -m pdserve.bench.serving.command is the same command)

Backends (bench/serving/backend.py): `grpc` (the default) speaks pdserve's own API to
`--addr`; `openai` (/v1/completions) and `openai-chat` (/v1/chat/completions) speak
the OpenAI HTTP API to `--base-url` (pdserve's `--http-port`, vLLM, SGLang, ...;
bench/serving/openai_backend.py), streamed, with the same report.

Without `--addr` / `--base-url` a local cluster (router + workers as processes,
`pdserve up`'s topology by default; its HTTP API on a free port for the openai
backends) is started first and stopped at the end, also on Ctrl-C, SIGTERM or an
error; against a running server the benchmark imports neither torch nor the engine.

Requests are open loop: each is sent at its arrival time whatever happened to the
earlier ones (Poisson by default, gamma-distributed gaps with `--burstiness`, all
at once with `--request-rate inf`, a trace's own times), at most `--concurrency` in
flight (0: no limit; with an infinite rate that is a fixed-concurrency run). Each
request runs on its own thread (gRPC channels are thread-safe; the openai backends'
I/O runs on one event loop the threads wait on) with a deadline (`--timeout`), so
the run always ends. Workloads: see bench/serving/workloads.py (random,
prefix, text, sharegpt, trace) and bench/serving/multiturn.py (multiturn: conversations
resending their history, turn after turn, with a think time between); every request is greedy with `ignore_eos`, so it
produces exactly its `max_tokens`; one that ends otherwise is a failure.
`--num-warmup` short requests go first and are not measured. Metrics: see
bench/serving/metrics.py (TTFT, TPOT, ITL, e2e on the client; the router's own TTFT/TPOT
beside them over gRPC; goodput under `--slo`).

Output: a progress bar on stderr (tqdm, when stderr is a terminal), the table, and
`--json FILE` (config, summary, one record per request with its token times),
`--plot FILE.png` (CDFs of TTFT and TPOT, output tokens/s over time). The exit
status is 0 when every request succeeded and the report is consistent, else 1.
The last line printed is `ttft_p50_ms=X tpot_p50_ms=Y` (client-side medians, `nan`
when nothing succeeded).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from pdserve.bench.cluster.clusters import ClusterConfig, local_cluster
from pdserve.bench.common.entry import ReportFlags, interrupt_on_sigterm, parse
from pdserve.bench.serving.backend import Backend, GrpcBackend
from pdserve.bench.serving.metrics import Slo
from pdserve.bench.serving.multiturn import make_conversations, measure_conversations
from pdserve.bench.serving.run import Measured, measure, table, warm_up, write_json
from pdserve.bench.serving.workloads import KINDS, ArrivalConfig, WorkloadConfig, make_workload
from pdserve.services.common.flags import flag
from pdserve.services.router.client import Client

BACKENDS = ("grpc", "openai", "openai-chat")
# Where --api-key is read from when not given (it stays out of the process list): `pdserve generate`'s for gRPC,
# the openai client's (and vLLM's benchmark's) for the HTTP API.
API_KEY_ENV = {"grpc": "PDSERVE_API_KEY", "openai": "OPENAI_API_KEY", "openai-chat": "OPENAI_API_KEY"}


@dataclass(frozen=True)
class BenchConfig:
    workload: WorkloadConfig = WorkloadConfig()
    arrivals: ArrivalConfig = ArrivalConfig()
    slo: Slo = Slo()
    cluster: ClusterConfig = ClusterConfig()
    backend: str = "grpc"  # BACKENDS
    addr: str | None = None  # grpc: the router; None: start a local cluster
    base_url: str | None = None  # openai backends: the server's …/v1; None: start a local cluster
    api_key: str | None = None
    served_model_name: str | None = None  # openai backends: the model id sent (None: the first /v1/models lists)
    timeout: float = 120.0  # deadline of every request, in seconds
    num_warmup: int = 1
    progress: bool | None = None  # None: when stderr is a terminal
    json_path: str | None = None
    plot_path: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend: one of {BACKENDS}, got {self.backend!r}")
        if self.addr is not None and self.backend != "grpc":
            raise ValueError(f"--addr: a gRPC router; --backend {self.backend} takes --base-url")
        if self.base_url is not None and self.backend == "grpc":
            raise ValueError("--base-url: for --backend openai or openai-chat (the gRPC backend takes --addr)")
        if not self.timeout > 0:
            raise ValueError(f"--timeout: must be > 0, got {self.timeout}")
        if self.num_warmup < 0:
            raise ValueError(f"--num-warmup: must be >= 0, got {self.num_warmup}")


QUICK_WORKLOAD = WorkloadConfig(num_requests=16, output_tokens=(16, 16), prompt_tokens=(8, 128),
                                prompt_chars=(32, 512), prefix_tokens=64)


# -- a measured run --------------------------------------------------------------------


@contextmanager
def target(cfg: BenchConfig) -> Iterator[str]:
    """The address the backend dials: the one given, or a local cluster's (its router,
    or its HTTP API's base URL for the openai backends)."""
    given = cfg.addr if cfg.backend == "grpc" else cfg.base_url
    if given:
        yield given
        return
    with local_cluster(replace(cfg.cluster, http=cfg.backend != "grpc")) as started:
        yield started.address if cfg.backend == "grpc" else started.openai_url


@contextmanager
def open_backend(cfg: BenchConfig, address: str) -> Iterator[Backend]:
    if cfg.backend == "grpc":
        with Client(address, timeout=cfg.timeout, api_key=cfg.api_key) as client:
            yield GrpcBackend(client)
        return
    from pdserve.bench.serving.openai_backend import OpenAiBackend

    tokenizer = cfg.workload.tokenizer or (cfg.cluster.model if cfg.base_url is None else None)
    with OpenAiBackend(address, chat=cfg.backend == "openai-chat", tokenizer=tokenizer, api_key=cfg.api_key,
                       model=cfg.served_model_name) as backend:
        yield backend


def benchmark(cfg: BenchConfig) -> tuple[Measured, str]:
    """Run the whole benchmark (cluster included); the run and a description of the target."""
    with target(cfg) as address, open_backend(cfg, address) as backend:
        model = backend.served()
        if cfg.workload.kind == "multiturn":
            conversations = make_conversations(cfg.workload, cfg.arrivals, model.vocab_size, model.max_model_len)
            warm_up(backend, cfg.num_warmup, cfg.timeout, model.vocab_size)
            run = measure_conversations(backend, conversations, concurrency=cfg.arrivals.concurrency,
                                        timeout=cfg.timeout, slo=cfg.slo, label="serving", progress=cfg.progress)
        else:
            requests = make_workload(cfg.workload, cfg.arrivals, model.vocab_size, model.max_model_len)
            warm_up(backend, cfg.num_warmup, cfg.timeout, model.vocab_size)
            run = measure(backend, requests, concurrency=cfg.arrivals.concurrency, timeout=cfg.timeout, slo=cfg.slo,
                          label="serving", progress=cfg.progress)
        where = "own local cluster" if (cfg.addr or cfg.base_url) is None else "running server"
        description = (f"{address} ({where}), backend {cfg.backend}, model {model.name}, "
                       f"max_model_len={model.max_model_len}")
    return run, description


# -- report ----------------------------------------------------------------------------


def describe(cfg: BenchConfig) -> list[str]:
    w, a = cfg.workload, cfg.arrivals
    shape = {
        "random": f"{w.prompt_tokens[0]}-{w.prompt_tokens[1]} random prompt tokens",
        "prefix": f"{w.prefix_count} prefixes of {w.prefix_tokens} tokens + {w.prompt_tokens[0]}-{w.prompt_tokens[1]} "
                  "unique ones",
        "text": f"{w.prompt_chars[0]}-{w.prompt_chars[1]} chars of stdlib source",
        "sharegpt": f"lengths from {w.path}",
        "trace": f"trace {w.path}, {w.trace_block_tokens} tokens per hash block, speedup {w.trace_speedup:g}",
        "multiturn": f"conversations of {w.turns[0]}-{w.turns[1]} turns resending their history, "
                     f"{w.prompt_tokens[0]}-{w.prompt_tokens[1]} new tokens a turn, think time {w.think_time:g}s",
    }[w.kind]
    outputs = "" if w.kind in ("sharegpt", "trace") else f", {w.output_tokens[0]}-{w.output_tokens[1]} output tokens"
    return [
        f"workload: {w.kind}, {w.num_requests} {'conversations' if w.kind == 'multiturn' else 'requests'}, "
        f"{shape}{outputs}, ignore_eos, greedy, seed={w.seed}",
        f"arrivals: request_rate={a.request_rate:g} req/s, burstiness={a.burstiness:g}, "
        f"concurrency={a.concurrency or 'unlimited'}, timeout={cfg.timeout:g}s, warm-up={cfg.num_warmup}",
    ]


def config_dict(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["slo"] = str(cfg.slo)
    return d


# -- command line --------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadFlags:
    workload: str = flag("random", "what is sent (bench/serving/workloads.py)", choices=KINDS)
    num_requests: int | None = flag(None, f"requests measured, multiturn: conversations "
                                          f"({WorkloadConfig.num_requests}; --quick {QUICK_WORKLOAD.num_requests})")
    output_tokens: tuple[int, int] | None = flag(None, "MIN MAX tokens generated per request, uniform "
                                                       f"({' '.join(map(str, WorkloadConfig.output_tokens))})")
    max_tokens: int | None = flag(None, "shorthand for --output-tokens N N")
    prompt_tokens: tuple[int, int] | None = flag(None, "MIN MAX random: prompt length; prefix: unique suffix length; "
                                                       "multiturn: each user message's length "
                                                       f"({' '.join(map(str, WorkloadConfig.prompt_tokens))})")
    prompt_chars: tuple[int, int] | None = flag(None, "MIN MAX text: characters per prompt")
    prefix_count: int = flag(WorkloadConfig.prefix_count, "prefix: shared prefixes")
    prefix_tokens: int | None = flag(None, f"prefix: tokens per shared prefix ({WorkloadConfig.prefix_tokens})")
    dataset: str | None = flag(None, "sharegpt / trace: a JSONL file")
    tokenizer: str | None = flag(None, "sharegpt conversations, openai backends (vocabulary, chat prompts' text): "
                                       "directory with tokenizer.json (default: --model, else the embedded model)")
    trace_block_tokens: int = flag(WorkloadConfig.trace_block_tokens, "trace: tokens per hash id (512 as recorded; "
                                                                      "smaller scales prompts down)")
    trace_speedup: float = flag(WorkloadConfig.trace_speedup, "trace: replay this many times faster")
    turns: tuple[int, int] = flag(WorkloadConfig.turns, "MIN MAX multiturn: turns per conversation, uniform")
    think_time: float = flag(WorkloadConfig.think_time, "multiturn: mean seconds between an answer and the next turn "
                                                        "(exponential; 0: none)")
    seed: int = flag(WorkloadConfig.seed, "seed of the workload and the arrivals")


@dataclass(frozen=True)
class LoadFlags:
    request_rate: float = flag(ArrivalConfig.request_rate, "requests per second (inf: all at once)")
    burstiness: float = flag(ArrivalConfig.burstiness, "gamma shape of the arrival gaps: 1 Poisson, <1 burstier")
    concurrency: int = flag(ArrivalConfig.concurrency, "most requests in flight (0: no limit)")
    timeout: float = flag(BenchConfig.timeout, "deadline of each request in seconds")
    num_warmup: int = flag(BenchConfig.num_warmup, "unmeasured requests sent first")


@dataclass(frozen=True)
class SummaryFlags:
    slo: str = flag("", "goodput bounds, e.g. ttft:500,tpot:50 (milliseconds)")
    progress: bool | None = flag(None, "progress bar on stderr (default: when stderr is a terminal)")


@dataclass(frozen=True)
class OwnClusterFlags:
    """The cluster started without --addr / --base-url."""

    model: str | None = flag(ClusterConfig.model, "model directory (default: the embedded model)")
    prefill: int = flag(ClusterConfig.prefill, "prefill workers")
    decode: int = flag(ClusterConfig.decode, "decode workers")
    mixed: int = flag(ClusterConfig.mixed, "mixed workers")
    num_blocks: int | None = flag(ClusterConfig.num_blocks, "KV blocks per worker (default: sized by the worker)")
    torch_threads: int = flag(ClusterConfig.torch_threads, "torch threads per worker")
    worker_cpus: str = flag(ClusterConfig.worker_cpus, "pin workers to CPUs, e.g. '0;1' (see pdserve up)")
    kv_connector: str | None = flag(ClusterConfig.kv_connector, "workers' KV transport: zmq | zmq_ipc | gloo | nccl | "
                                                                "none (default: ZeroMQ tcp)")
    prefix_caching: bool = flag(ClusterConfig.enable_prefix_caching, "workers with a prefix cache")
    prefill_policy: str = flag(ClusterConfig.prefill_policy, "router's prefill choice: prefix | round_robin")
    device: str = flag(ClusterConfig.device, "workers' torch device (cuda for the GPU mode)")
    dtype: str = flag(ClusterConfig.dtype, "workers' dtype: float32 | float16 | bfloat16")
    startup_timeout: float = flag(ClusterConfig.startup_timeout, "seconds for the cluster to be ready")
    metrics: bool = flag(ClusterConfig.metrics, "Prometheus metrics in every service (--no-metrics: off, to measure "
                                                "their cost)")


@dataclass(frozen=True)
class ServingFlags:
    """`pdserve bench`'s command line: its own flags, then each block's (one level)."""

    backend: str = flag("grpc", "grpc: pdserve's own API; openai / openai-chat: the OpenAI HTTP API's "
                                "/v1/completions / /v1/chat/completions", choices=BACKENDS)
    addr: str | None = flag(None, "grpc: router of a running cluster (default: start a local one)")
    base_url: str | None = flag(None, "openai backends: base URL of a running OpenAI-compatible server, e.g. "
                                      "http://127.0.0.1:8000/v1 (default: start a local cluster with its HTTP API)")
    served_model_name: str | None = flag(None, "openai backends: the model id to send (default: the first one "
                                               "/v1/models lists)")
    api_key: str | None = flag(None, "sent as `Authorization: Bearer KEY` (default: $PDSERVE_API_KEY for grpc, "
                                     "$OPENAI_API_KEY for the openai backends, which keep it out of the process list)",
                               env=False)
    quick: bool = flag(False, f"{QUICK_WORKLOAD.num_requests} requests of {QUICK_WORKLOAD.output_tokens[0]} tokens, "
                              "shorter prompts (explicit flags still win)")
    workload: WorkloadFlags = flag(WorkloadFlags(), "what is sent")
    load: LoadFlags = flag(LoadFlags(), "when it is sent")
    summary: SummaryFlags = flag(SummaryFlags(), "what is reported")
    report: ReportFlags = flag(ReportFlags(), "where the report is written: JSON (per-request records too), a PNG "
                                             "(TTFT/TPOT CDFs, tokens/s over time)")
    cluster: OwnClusterFlags = flag(OwnClusterFlags(), "the own cluster (without --addr)")


def config_from(flags: ServingFlags) -> BenchConfig:
    w, a, s, c = flags.workload, flags.load, flags.summary, flags.cluster
    base = QUICK_WORKLOAD if flags.quick else WorkloadConfig()
    output = (w.max_tokens, w.max_tokens) if w.max_tokens is not None else w.output_tokens
    given = {"num_requests": w.num_requests, "output_tokens": output, "prompt_tokens": w.prompt_tokens,
             "prompt_chars": w.prompt_chars, "prefix_tokens": w.prefix_tokens, "path": w.dataset,
             "tokenizer": w.tokenizer}
    workload = replace(base, kind=w.workload, seed=w.seed, prefix_count=w.prefix_count,
                       trace_block_tokens=w.trace_block_tokens, trace_speedup=w.trace_speedup, turns=w.turns,
                       think_time=w.think_time,
                       **{k: v for k, v in given.items() if v is not None})
    arrivals = ArrivalConfig(a.request_rate, a.burstiness, a.concurrency)
    cluster = ClusterConfig(model=c.model, prefill=c.prefill, decode=c.decode, mixed=c.mixed,
                            num_blocks=c.num_blocks, torch_threads=c.torch_threads, kv_connector=c.kv_connector,
                            worker_cpus=c.worker_cpus, enable_prefix_caching=c.prefix_caching,
                            prefill_policy=c.prefill_policy, device=c.device, dtype=c.dtype,
                            startup_timeout=c.startup_timeout, metrics=c.metrics)
    api_key = flags.api_key or os.environ.get(API_KEY_ENV[flags.backend]) or None
    return BenchConfig(workload, arrivals, Slo.parse(s.slo), cluster, flags.backend, flags.addr, flags.base_url,
                       api_key, flags.served_model_name, a.timeout, a.num_warmup, s.progress, flags.report.json,
                       flags.report.plot)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(ServingFlags, argv, "pdserve bench", __doc__, config_from)
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)  # unwind: the cluster is stopped on the way out
    try:
        run, description = benchmark(cfg)
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except (ConnectionError, RuntimeError, OSError, ValueError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    print(f"target: {description}")
    print(*describe(cfg), sep="\n")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in run.load_avg)}")
    print(table(run.summary))
    problems = run.problems()
    for problem in problems:
        print(f"INCONSISTENT: {problem}")
    if cfg.json_path:
        write_json(cfg.json_path, {"config": config_dict(cfg), **run.to_dict()})
        print(f"report written to {cfg.json_path}")
    if cfg.plot_path:
        from pdserve.bench.common.plot import Run, plot_runs

        plot_runs([Run(run.label, run.start, run.results)], cfg.plot_path, title=describe(cfg)[0])
        print(f"plot written to {cfg.plot_path}")
    print(f"ttft_p50_ms={run.summary.ttft.p50:.2f} tpot_p50_ms={run.summary.tpot.p50:.2f}", flush=True)
    return 0 if run.summary.failed == 0 and not problems else 1


if __name__ == "__main__":
    sys.exit(main())

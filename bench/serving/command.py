"""`pdserve bench`: an open-loop load generator and latency report for any pdserve router.

    pdserve bench --quick                                  # own small cluster, < 1 minute
    pdserve bench --addr 127.0.0.1:50051 --request-rate 4 --burstiness 0.5 --slo ttft:500,tpot:50
    pdserve bench --workload prefix --prefix-count 4 --prefix-tokens 512 --json run.json --plot run.png
    pdserve bench --workload trace --dataset mooncake_trace.jsonl --trace-block-tokens 16
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
prefix, text, sharegpt, trace); every request is greedy with `ignore_eos`, so it
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

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from pdserve.bench.cluster.clusters import ClusterConfig, local_cluster
from pdserve.bench.common.entry import interrupt_on_sigterm
from pdserve.bench.serving.backend import Backend, GrpcBackend
from pdserve.bench.serving.metrics import Slo
from pdserve.bench.serving.run import Measured, measure, table, warm_up, write_json
from pdserve.bench.serving.workloads import KINDS, ArrivalConfig, WorkloadConfig, make_workload
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
    }[w.kind]
    outputs = "" if w.kind in ("sharegpt", "trace") else f", {w.output_tokens[0]}-{w.output_tokens[1]} output tokens"
    return [
        f"workload: {w.kind}, {w.num_requests} requests, {shape}{outputs}, ignore_eos, greedy, seed={w.seed}",
        f"arrivals: request_rate={a.request_rate:g} req/s, burstiness={a.burstiness:g}, "
        f"concurrency={a.concurrency or 'unlimited'}, timeout={cfg.timeout:g}s, warm-up={cfg.num_warmup}",
    ]


def config_dict(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["slo"] = str(cfg.slo)
    return d


# -- command line --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    w, a, c, b = WorkloadConfig(), ArrivalConfig(), ClusterConfig(), BenchConfig()
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default=b.backend,
                   help="grpc: pdserve's own API; openai / openai-chat: the OpenAI HTTP API's /v1/completions / "
                        "/v1/chat/completions (default grpc)")
    p.add_argument("--addr", help="grpc: router of a running cluster (default: start a local one)")
    p.add_argument("--base-url", help="openai backends: base URL of a running OpenAI-compatible server, e.g. "
                                      "http://127.0.0.1:8000/v1 (default: start a local cluster with its HTTP API)")
    p.add_argument("--served-model-name", help="openai backends: the model id to send (default: the first one "
                                               "/v1/models lists)")
    p.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer KEY` (default: $PDSERVE_API_KEY for grpc, $OPENAI_API_KEY "
                        "for the openai backends, which keep it out of the process list)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_WORKLOAD.num_requests} requests of {QUICK_WORKLOAD.output_tokens[0]} tokens, shorter "
                        "prompts (explicit flags still win)")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=KINDS, default=w.kind)
    g.add_argument("--num-requests", type=int, help=f"default {w.num_requests}")
    g.add_argument("--output-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"tokens generated per request, uniform (default {w.output_tokens[0]} {w.output_tokens[1]})")
    g.add_argument("--max-tokens", type=int, help="shorthand for --output-tokens N N")
    g.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"random: prompt length; prefix: unique suffix length (default {w.prompt_tokens[0]} "
                        f"{w.prompt_tokens[1]})")
    g.add_argument("--prompt-chars", type=int, nargs=2, metavar=("MIN", "MAX"), help="text: characters per prompt")
    g.add_argument("--prefix-count", type=int, default=w.prefix_count, help="prefix: shared prefixes")
    g.add_argument("--prefix-tokens", type=int, help=f"prefix: tokens per shared prefix (default {w.prefix_tokens})")
    g.add_argument("--dataset", help="sharegpt / trace: a JSONL file")
    g.add_argument("--tokenizer", help="sharegpt conversations, openai backends (vocabulary, chat prompts' text): "
                                       "directory with tokenizer.json (default: --model, else the embedded model)")
    g.add_argument("--trace-block-tokens", type=int, default=w.trace_block_tokens,
                   help="trace: tokens per hash id (512 as recorded; smaller scales prompts down)")
    g.add_argument("--trace-speedup", type=float, default=w.trace_speedup, help="trace: replay this many times faster")
    g.add_argument("--seed", type=int, default=w.seed)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=a.request_rate,
                   help="requests per second (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=a.burstiness,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier")
    g.add_argument("--concurrency", type=int, default=a.concurrency, help="most requests in flight (0: no limit)")
    g.add_argument("--timeout", type=float, default=b.timeout, help="deadline of each request in seconds")
    g.add_argument("--num-warmup", type=int, default=b.num_warmup, help="unmeasured requests sent first")
    g = p.add_argument_group("report")
    g.add_argument("--slo", default="", help="goodput bounds, e.g. ttft:500,tpot:50 (milliseconds)")
    g.add_argument("--json", dest="json_path", metavar="FILE", help="write the full report (per-request records too)")
    g.add_argument("--plot", dest="plot_path", metavar="FILE.png", help="TTFT/TPOT CDFs and tokens/s over time")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    g = p.add_argument_group("own cluster (without --addr)")
    g.add_argument("--model", default=c.model, help="model directory (default: the embedded model)")
    g.add_argument("--prefill", type=int, default=c.prefill)
    g.add_argument("--decode", type=int, default=c.decode)
    g.add_argument("--mixed", type=int, default=c.mixed)
    g.add_argument("--num-blocks", type=int, default=c.num_blocks, help="KV blocks per worker (default: sized by the worker)")
    g.add_argument("--torch-threads", type=int, default=c.torch_threads, help="per worker")
    g.add_argument("--worker-cpus", default=c.worker_cpus, help="pin workers to CPUs, e.g. '0;1' (see pdserve up)")
    g.add_argument("--kv-connector", default=c.kv_connector,
                   help="workers' KV transport: zmq | zmq_ipc | gloo | nccl | none (default: ZeroMQ tcp)")
    g.add_argument("--no-prefix-caching", action="store_true", help="workers without a prefix cache")
    g.add_argument("--prefill-policy", default=c.prefill_policy, help="router's prefill choice: prefix | round_robin")
    g.add_argument("--device", default=c.device, help="workers' torch device (cuda for the GPU mode)")
    g.add_argument("--dtype", default=c.dtype, help="workers' dtype: float32 | float16 | bfloat16")
    g.add_argument("--startup-timeout", type=float, default=c.startup_timeout)
    g.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=c.metrics,
                   help="Prometheus metrics in every service (--no-metrics: off, to measure their cost)")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    base = QUICK_WORKLOAD if args.quick else WorkloadConfig()
    output = (args.max_tokens, args.max_tokens) if args.max_tokens is not None else args.output_tokens
    given = {
        "num_requests": args.num_requests, "output_tokens": tuple(output) if output else None,
        "prompt_tokens": tuple(args.prompt_tokens) if args.prompt_tokens else None,
        "prompt_chars": tuple(args.prompt_chars) if args.prompt_chars else None,
        "prefix_tokens": args.prefix_tokens, "path": args.dataset, "tokenizer": args.tokenizer,
    }
    workload = replace(base, kind=args.workload, seed=args.seed, prefix_count=args.prefix_count,
                       trace_block_tokens=args.trace_block_tokens, trace_speedup=args.trace_speedup,
                       **{k: v for k, v in given.items() if v is not None})
    arrivals = ArrivalConfig(args.request_rate, args.burstiness, args.concurrency)
    cluster = ClusterConfig(model=args.model, prefill=args.prefill, decode=args.decode, mixed=args.mixed,
                            num_blocks=args.num_blocks, torch_threads=args.torch_threads, kv_connector=args.kv_connector,
                            worker_cpus=args.worker_cpus, enable_prefix_caching=not args.no_prefix_caching,
                            prefill_policy=args.prefill_policy, device=args.device, dtype=args.dtype,
                            startup_timeout=args.startup_timeout, metrics=args.metrics)
    return BenchConfig(workload, arrivals, Slo.parse(args.slo), cluster, args.backend, args.addr, args.base_url,
                       args.api_key or os.environ.get(API_KEY_ENV[args.backend]) or None, args.served_model_name, args.timeout,
                       args.num_warmup, args.progress, args.json_path, args.plot_path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
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

"""What does the HTTP layer cost? The same requests through pdserve's gRPC API and its
OpenAI-compatible HTTP API (completions and chat), on one cluster, interleaved.

    python -m pdserve.bench.serving.http              # about 4 minutes on 2 CPU cores
    python -m pdserve.bench.serving.http --concurrency 8   # the router's cost under load
    python -m pdserve.bench.serving.http --quick      # the smoke test
    python -m pdserve.bench.serving.http --addr ROUTER --base-url http://HOST:PORT/v1
                                              # a running pdserve (without prefix caching)

Systems, all against the same router:

    grpc         Generation.Generate, the prompt as token ids          (bench/serving/backend.py)
    openai       POST /v1/completions, the same token ids, streamed SSE (bench/serving/openai_backend.py)
    openai-chat  POST /v1/chat/completions, one user message whose chat-templated tokens
                 are those ids; the router renders and tokenizes it itself

Without --addr one cluster is started (`pdserve up`'s topology: 1 prefill + 1 decode
worker, KV over ZeroMQ tcp, the router's HTTP API on a free port), so the systems
differ only in the front end. Its workers have no prefix cache: every system sends
the same prompts, and each after the first would otherwise find them cached (a run
that sees a cache hit reports it as inconsistent).

Workload, drawn per repetition (seed + repetition): random token ids decoded to
text are the chat message; its tokens as the chat route makes them (POST /tokenize
with the messages: the router's template and tokenizer) are the prompt the grpc and
openai systems send, so all three prefill the same tokens (checked: each chat
request's usage.prompt_tokens). Greedy, ignore_eos, `--output-tokens` each;
`--concurrency` requests in flight, sent back to back. A repetition runs grpc,
openai, openai-chat in turn (A B C A B C ...; bench/common/repeat.py). By default a
repetition is one request: the three systems send the same prompt within a second
of each other, each alone on the cluster (TTFT is the front end's latency, not a
wait behind other requests), and the figures are medians over 150 such triples. On
a shared machine, load that drifts over seconds moved 16-request repetitions taken
10 s apart by +-10-20 ms; request by request it hits the three systems alike.
`--num-requests 32 --concurrency 8 --repeats 10` measures under load.

TTFT: sending -> the first token (gRPC) or the first chunk carrying text (HTTP: the
chat role chunk does not count). Reported per HTTP system against grpc, per
repetition, then as the median with min-max: the TTFT p50 difference in ms and the
TPOT p50 ratio. Issue 18's target: at most +2 ms TTFT p50 and +5 % TPOT p50. The CPU
seconds the router and this load generator spent on each system are printed beside
them (own cluster), as that is where an HTTP layer's cost shows first, and so is
the router's own TTFT (its time_to_first_token_seconds histogram, read around every
run: arrival at the front end -> the first token leaving it, the same code for both
APIs), which splits a TTFT difference into the front end's share and the rest (HTTP
parsing, the hops into and out of the front end, SSE, the client).

The last line is `ttft_p50_delta_ms=X tpot_p50_ratio=Y`: openai-chat against grpc,
medians over repetitions.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

from pdserve.bench.common.entry import ReportFlags, compare_entry, overridden
from pdserve.bench.serving.backend import Backend, GrpcBackend
from pdserve.bench.cluster.clusters import ClusterConfig, Started, local_cluster, say
from pdserve.bench.serving.metrics import Slo
from pdserve.bench.serving.openai_backend import OpenAiBackend
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio
from pdserve.bench.serving.run import Measured, measure, table, warm_up, write_json
from pdserve.bench.serving.workloads import BenchRequest, load_tokenizer, random_ids
from pdserve.services.common.flags import flag
from pdserve.services.router.client import Client

SYSTEMS = ("grpc", "openai", "openai-chat")
HTTP_SYSTEMS = SYSTEMS[1:]
TARGET_TTFT_MS = 2.0  # issue 18: what the HTTP layer may add to TTFT p50 ...
TARGET_TPOT_RATIO = 1.05  # ... and to TPOT p50


@dataclass(frozen=True)
class HttpBenchConfig:
    num_requests: int = 1  # per repetition and system: 1 pairs the systems request by request
    concurrency: int = 1  # one at a time: the layer's own latency, not queueing behind other requests
    prompt_tokens: tuple[int, int] = (128, 384)  # random ids before the chat template
    output_tokens: int = 32
    repeats: int = 150
    seed: int = 0
    addr: str | None = None  # a running router (with base_url); None: start a cluster
    base_url: str | None = None
    tokenizer: str | None = None  # of the served model (default: the embedded model's)
    api_key: str | None = None
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.num_requests < 1 or self.concurrency < 1 or self.output_tokens < 2:
            raise ValueError("--repeats, --num-requests and --concurrency must be >= 1, --output-tokens >= 2")
        lo, hi = self.prompt_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"--prompt-tokens: needs 1 <= MIN <= MAX, got {lo} {hi}")
        if (self.addr is None) != (self.base_url is None):
            raise ValueError("--addr and --base-url: both (a running cluster) or neither (start one)")


QUICK = HttpBenchConfig(num_requests=6, concurrency=2, prompt_tokens=(16, 64), output_tokens=8, repeats=2)
CLUSTER = ClusterConfig(enable_prefix_caching=False, http=True)


# -- workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompts:
    """One repetition's prompts: the chat message of each request and its tokens."""

    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]

    def requests(self, system: str, output_tokens: int) -> list[BenchRequest]:
        prompts: Sequence[str | tuple[int, ...]] = self.texts if system == "openai-chat" else self.token_ids
        return [BenchRequest(i, p, output_tokens, 0.0) for i, p in enumerate(prompts)]


def make_prompts(cfg: HttpBenchConfig, tokenizer, chat_tokens: Callable[[str], list[int]], vocab_size: int,
                 rep: int) -> Prompts:
    rng = random.Random(f"http-{cfg.seed}-{rep}")
    texts = tuple(tokenizer.decode(list(random_ids(rng.randint(*cfg.prompt_tokens), vocab_size, rng)))
                  for _ in range(cfg.num_requests))
    return Prompts(texts, tuple(tuple(chat_tokens(text)) for text in texts))


def chat_tokenizer(http: OpenAiBackend) -> Callable[[str], list[int]]:
    """A user message's prompt tokens as the server's chat route makes them (POST
    /tokenize with `messages`, vLLM's shape, at the root beside /v1)."""
    import httpx

    root = http.address.rstrip("/").removesuffix("/v1")
    headers = http.headers

    def tokens(text: str) -> list[int]:
        body = {"model": http.model, "messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
        reply = httpx.post(f"{root}/tokenize", json=body, headers=headers, timeout=30.0)
        if reply.status_code != 200:
            raise RuntimeError(f"POST {root}/tokenize: HTTP {reply.status_code}: {reply.text[:300]}")
        return list(reply.json()["tokens"])

    return tokens


# -- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    addr: str
    base_url: str
    started: Started | None  # own cluster: its processes' CPU time is read


@contextlib.contextmanager
def target(cfg: HttpBenchConfig) -> Iterator[Target]:
    if cfg.addr is not None and cfg.base_url is not None:
        yield Target(cfg.addr, cfg.base_url, None)
        return
    with local_cluster(CLUSTER) as started:
        yield Target(started.address, started.openai_url, started)


def line(run: Measured, cpu: str) -> str:
    s = run.summary
    return (f"{run.label:<12} {s.completed}/{s.num_requests} ok  TTFT p50 {s.ttft.p50:7.2f} ms  "
            f"TPOT p50 {s.tpot.p50:6.2f} ms  ITL p50 {s.itl.p50:6.2f} ms  E2E p50 {s.e2e.p50:7.1f} ms  "
            f"{cpu}load {run.load_avg[0]:.2f}")


def run(cfg: HttpBenchConfig, log: Callable[[str], None] = say, json_path: str | None = None,
        plot_path: str | None = None) -> tuple[str, list[str]]:
    with target(cfg) as where, Client(where.addr, timeout=cfg.timeout, api_key=cfg.api_key) as client, \
            OpenAiBackend(where.base_url, chat=False, tokenizer=cfg.tokenizer, api_key=cfg.api_key) as completions, \
            OpenAiBackend(where.base_url, chat=True, tokenizer=cfg.tokenizer, api_key=cfg.api_key) as chat:
        backends = {"grpc": GrpcBackend(client), "openai": completions, "openai-chat": chat}
        return _measure_all(cfg, where, backends, log, json_path, plot_path)


def _measure_all(cfg: HttpBenchConfig, where: Target, backends: dict[str, Backend], log: Callable[[str], None],
                 json_path: str | None, plot_path: str | None) -> tuple[str, list[str]]:
    info = backends["grpc"].served()
    for name in HTTP_SYSTEMS:
        backends[name].served()  # the model id they send
    tokenizer = load_tokenizer(cfg.tokenizer)
    vocab = min(info.vocab_size, tokenizer.get_vocab_size(with_added_tokens=False))
    chat_tokens = chat_tokenizer(backends["openai-chat"])
    log(f"target: router {where.addr}, HTTP API {where.base_url} ({'own cluster' if where.started else 'running'}); "
        f"model {info.name} (vocab {info.vocab_size}, max_model_len {info.max_model_len})")
    log(f"workload: {cfg.num_requests} requests per repetition and system, {cfg.prompt_tokens[0]}-{cfg.prompt_tokens[1]} "
        f"random tokens as text in one chat message (its chat-templated tokens for grpc and openai), "
        f"{cfg.output_tokens} output tokens, greedy, ignore_eos; {cfg.concurrency} in flight, back to back; "
        f"{cfg.repeats} repetitions, interleaved ({', '.join(SYSTEMS)}); seed {cfg.seed} + repetition")
    log(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for backend in backends.values():
        warm_up(backend, 2, cfg.timeout, vocab)
    prompts: dict[int, Prompts] = {}
    cpu: dict[str, dict[str, float]] = {name: {"router": 0.0, "bench": 0.0} for name in SYSTEMS}
    router_ttft: dict[str, list[float]] = {name: [] for name in SYSTEMS}  # ms, each run's mean

    def system(name: str) -> Callable[[int], Measured]:
        def once(rep: int) -> Measured:
            if rep not in prompts:
                prompts[rep] = make_prompts(cfg, tokenizer, chat_tokens, vocab, rep)
            ttft_before = _router_ttft(where)
            router_before, me_before = _router_cpu(where), time.process_time()
            result = measure(backends[name], prompts[rep].requests(name, cfg.output_tokens),
                             concurrency=cfg.concurrency, timeout=cfg.timeout, slo=Slo(), label=name)
            router, me = _router_cpu(where) - router_before, time.process_time() - me_before
            (s0, c0), (s1, c1) = ttft_before, _router_ttft(where)
            router_ttft[name].append((s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else math.nan)
            cpu[name]["router"] += router
            cpu[name]["bench"] += me
            used = f"CPU router {router:5.2f} s bench {me:5.2f} s  " if where.started else ""
            if rep < 2 or (rep + 1) % max(1, cfg.repeats // 10) == 0:  # ~10 lines per system, not 150
                log(f"[{rep + 1}/{cfg.repeats}] {line(result, used)}")
            return result

        return once

    runs = interleaved({name: system(name) for name in SYSTEMS}, cfg.repeats)
    ttft = {name: [r.summary.ttft.p50 for r in rs] for name, rs in runs.items()}
    tpot = {name: [r.summary.tpot.p50 for r in rs] for name, rs in runs.items()}
    # Ratio.of: the median of per-repetition values with their min and max (here differences, in ms)
    deltas = {name: Ratio.of([h - g for h, g in zip(ttft[name], ttft["grpc"])]) for name in HTTP_SYSTEMS}
    ratios = {name: Ratio.paired(tpot[name], tpot["grpc"]) for name in HTTP_SYSTEMS}
    last = cfg.repeats - 1
    if cfg.num_requests > 1:
        for name in SYSTEMS:
            log(table(runs[name][last].summary, f"{name}, repetition {cfg.repeats}"))
    for name in SYSTEMS:
        log(f"{name:<12} median over repetitions: TTFT p50 {Ratio.of(ttft[name]).median:7.2f} ms, "
            f"TPOT p50 {Ratio.of(tpot[name]).median:6.3f} ms")
    for name in HTTP_SYSTEMS:
        log(f"TTFT p50 {name} - grpc (ms): {deltas[name]}")
        log(f"TPOT p50 {name} / grpc: {ratios[name]}")
    inside = {name: Ratio.of([h - g for h, g in zip(router_ttft[name], router_ttft["grpc"])]) for name in HTTP_SYSTEMS}
    if not math.isnan(inside["openai"].median):
        for name in HTTP_SYSTEMS:
            outside = Ratio.of([(h - g) - (rh - rg) for h, g, rh, rg in
                                zip(ttft[name], ttft["grpc"], router_ttft[name], router_ttft["grpc"])])
            log(f"  of which in the router's own TTFT (mean per run, {name} - grpc, ms): {inside[name]}; "
                f"outside it (HTTP, hops, SSE, client): {outside}")
    if where.started:
        tokens = cfg.repeats * cfg.num_requests * cfg.output_tokens
        log("CPU per output token over all repetitions: " + "; ".join(
            f"{name}: router {cpu[name]['router'] / tokens * 1e3:.3f} ms, bench {cpu[name]['bench'] / tokens * 1e3:.3f} ms"
            for name in SYSTEMS))
    for name in HTTP_SYSTEMS:
        met = deltas[name].median <= TARGET_TTFT_MS and ratios[name].median <= TARGET_TPOT_RATIO
        log(f"target (issue 18: TTFT p50 +<= {TARGET_TTFT_MS:g} ms, TPOT p50 +<= {TARGET_TPOT_RATIO - 1:.0%}): {name} "
            f"{deltas[name].median:+.2f} ms, {ratios[name].median - 1:+.1%}: {'met' if met else 'NOT met'}")
    problems = _problems(runs, prompts)
    if json_path:
        write_json(json_path, {"config": asdict(cfg), "ttft_p50_delta_ms": {n: asdict(d) for n, d in deltas.items()},
                               "router_ttft_mean_ms": router_ttft,
                               "tpot_p50_ratio": {n: asdict(r) for n, r in ratios.items()}, "cpu_seconds": cpu,
                               "runs": {name: [r.to_dict() for r in rs] for name, rs in runs.items()}})
    if plot_path:
        from pdserve.bench.common.plot import Run, plot_runs

        plot_runs([Run(name, runs[name][last].start, runs[name][last].results) for name in SYSTEMS], plot_path,
                  title=f"gRPC vs HTTP, repetition {cfg.repeats}")
    chat = "openai-chat"
    return f"ttft_p50_delta_ms={deltas[chat].median:.3f} tpot_p50_ratio={ratios[chat].median:.3f}", problems


def _router_cpu(where: Target) -> float:
    return where.started.cpu_seconds()["router"] if where.started else 0.0


def _router_ttft(where: Target) -> tuple[float, float]:
    """(sum of seconds, count) of the router's TTFT histogram so far; (0, 0) without
    its /metrics (a running cluster, or --no-metrics)."""
    if not (where.started and where.started.router_metrics):
        return 0.0, 0.0
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{where.started.router_metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    total = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve:time_to_first_token_seconds":
            for sample in family.samples:
                kind = sample.name.rpartition("_")[2]
                if kind in total:
                    total[kind] += sample.value
    return total["sum"], total["count"]


def _problems(runs: dict[str, list[Measured]], prompts: dict[int, Prompts]) -> list[str]:
    """Each run's own inconsistencies and failures, a chat prompt the router counted
    otherwise than /tokenize did (then the systems did not prefill the same tokens),
    and prefix-cache hits (then a later system found an earlier one's blocks)."""
    problems = []
    for name, rs in runs.items():
        for i, r in enumerate(rs):
            where = f"{name} repetition {i + 1}"
            problems += [f"{where}: {p}" for p in r.problems()]
            if r.summary.failed:
                problems.append(f"{where}: {r.summary.failed} failed: {r.summary.errors[:3]}")
            if r.summary.cached_tokens:
                problems.append(f"{where}: {r.summary.cached_tokens} prompt tokens from a prefix cache (the comparison "
                                "needs workers without one: --no-enable-prefix-caching)")
            if name == "openai-chat":
                counted = [x.prompt_tokens for x in r.results if x.ok]
                sent = [len(ids) for x, ids in zip(r.results, prompts[i].token_ids) if x.ok]
                if counted != sent:
                    problems.append(f"{where}: the router counted chat prompts of {counted[:4]}... tokens, /tokenize "
                                    f"{sent[:4]}...")
    return problems


# -- command line -----------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpFlags:
    """The command line; a flag left out keeps the preset's value."""

    quick: bool = flag(False, "few short requests, 2 repetitions (the smoke test)")
    repeats: int | None = flag(None, "interleaved repetitions (150)")
    num_requests: int | None = flag(None, "per repetition and system (1)")
    concurrency: int | None = flag(None, "requests in flight (1)")
    prompt_tokens: tuple[int, int] | None = flag(None, "MIN MAX random prompt tokens (128 384)")
    output_tokens: int | None = flag(None, "tokens generated per request (32)")
    seed: int | None = flag(None, "seed of the prompts")
    addr: str | None = flag(None, "a running cluster's router (with --base-url; its workers without a prefix cache)")
    base_url: str | None = flag(None, "the same router's HTTP API, e.g. http://127.0.0.1:8000/v1")
    tokenizer: str | None = flag(None, "directory with the served model's tokenizer.json (default: the embedded model)")
    api_key: str | None = flag(None, "sent on both APIs (better: $PDSERVE_API_KEY, off the process list)")
    report: ReportFlags = flag(ReportFlags(), "where the report is written")


def config_from(flags: HttpFlags) -> HttpBenchConfig:
    return overridden(QUICK if flags.quick else HttpBenchConfig(), flags)


def main(argv: Sequence[str] | None = None) -> int:
    return compare_entry("bench.serving.http", HttpFlags, argv, __doc__, config_from, run)


if __name__ == "__main__":
    sys.exit(main())

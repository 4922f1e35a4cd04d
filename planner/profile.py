"""`pdserve profile`: what one worker's engine steps cost on this machine, written to a
JSON file the planner's simulator reads.

    pdserve profile --output profile.json [--quick] [--repeats N] [a worker's flags:
        --model --dtype --quantization --kv-cache-dtype --block-size --num-blocks
        --max-num-batched-tokens --max-num-seqs --max-model-len --enforce-eager
        --torch-threads --cpu-affinity --device ...]

Measured in this process, on the engine a worker started with the same flags runs
(its memory plan, kernels, threads and pinning: services/node.py `prepare`):

    prefill   one engine step that prefills `tokens` new prompt tokens of one request
              after `cached` tokens its prompt starts with are in the prefix cache
              (tokens up to --max-num-batched-tokens; cached 0 and block-aligned
              lengths; the step's scheduled tokens are read back from the engine, so
              a point says what the step really did)
    decode    one engine step in which each of `batch` sequences of `context` tokens
              decodes one token (batch up to --max-num-seqs; the points the KV pool
              holds)
    transfer  a KV block of this model (its bytes per block) over ZeroMQ tcp on
              loopback: seconds per block in a stream of blocks, and the latency of
              one block alone; the transport's own cost, what the engine adds to it
              is the prefill and decode steps above
    serving   (--serving) what the serving path adds, measured through real clusters
              of the same flags on this machine (one mixed worker; one prefill and
              one decode worker) and the project's Client: per request (TTFT less the
              prefill step), how much slower a long prompt's prefill runs there than
              alone, per prompt that crosses (its TTFT less a local one's),
              and per decode step (inter-token time less the engine's step) as a line
              in the batch size: the router, the gRPC streams, the workers' loops

Each point is the median of --repeats runs (min and max kept beside it). Prompts are
random token ids, fresh for each run, so nothing is cached but what a point says.
The file says what produced it: the model (name, architecture, sizes, a digest of
its config.json), dtype, weight scheme, KV dtype and bytes, block size, the flags,
the machine (CPU model, ISA, cores usable, torch threads; the GPU where one ran), the
pdserve version and when. `Profile.read` checks its format; `prefill_seconds` and
`decode_seconds` interpolate between the points (linearly, extrapolating from the
last two past either end), which is what the simulator asks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import statistics
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pdserve.services.common.flags import check, flag
from pdserve.services.worker.config import WorkerConfig

log = logging.getLogger(__name__)
FORMAT = "pdserve-profile/1"
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_CACHED = (0, 256, 1024, 4096)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (64, 256, 1024, 4096)
QUICK = dict(tokens=(16, 128, 512), cached=(0, 256), batches=(1, 4, 16), contexts=(64, 512))
FIRST_TOKEN_ID = 8  # random prompts avoid the lowest ids (special tokens in most vocabularies)


@dataclass(frozen=True)
class ProfileConfig:
    output: str = flag("profile.json", "where to write the profile (JSON)")
    quick: bool = flag(False, "fewer points and one run each (a smoke test, not a plan's evidence)")
    repeats: int = flag(3, "runs per point (the median is kept, with min and max)")
    decode_steps: int = flag(8, "decode steps timed per run of a decode point")
    transfer_blocks: int = flag(256, "KV blocks streamed per run of the transfer measurement")
    serving: bool = flag(False, "also measure what the serving path adds (a real one-worker cluster on this machine)")
    # the engine's flags, as a worker reads them (a factory: the default model is checked only when used)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        check(self.repeats >= 1, "repeats", "must be at least 1", self.repeats)
        check(self.decode_steps >= 1, "decode_steps", "must be at least 1", self.decode_steps)
        check(self.transfer_blocks >= 1, "transfer_blocks", "must be at least 1", self.transfer_blocks)


@dataclass(frozen=True)
class Point:
    """One measured cost: seconds (median) with min and max over the runs."""

    seconds: float
    low: float
    high: float
    runs: int

    @classmethod
    def of(cls, times: Sequence[float]) -> "Point":
        return cls(statistics.median(times), min(times), max(times), len(times))


@dataclass(frozen=True)
class Profile:
    """A profile as written and read (the module docstring)."""

    source: dict  # what produced it: model, dtype, flags, machine, version, date
    prefill: list[dict] = field(default_factory=list)  # {"tokens", "cached", seconds, low, high, runs}
    decode: list[dict] = field(default_factory=list)  # {"batch", "context", seconds, low, high, runs}
    transfer: dict = field(default_factory=dict)  # bytes_per_block, seconds_per_block, latency_seconds, transport
    format: str = FORMAT
    # request_seconds, step_seconds, step_seconds_per_sequence ({}: not measured)
    serving: dict = field(default_factory=dict)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> "Profile":
        """The profile in `path`; ValueError naming what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"profile: cannot read {path}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"profile: {path} is not a {FORMAT} file (format {data.get('format')!r})"
                             if isinstance(data, dict) else f"profile: {path} is not a JSON object")
        for key in ("prefill", "decode"):
            if not data.get(key):
                raise ValueError(f"profile: {path} has no {key} points")
        return cls(data["source"], data["prefill"], data["decode"], data.get("transfer", {}), data["format"],
                   data.get("serving", {}))

    def prefill_seconds(self, tokens: int, cached: int = 0) -> float:
        """One prefill step of `tokens` new tokens after `cached` ones (interpolated)."""
        return _grid(self.prefill, "cached", "tokens", cached, tokens)

    def decode_seconds(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences of `context` tokens (interpolated)."""
        return _grid(self.decode, "context", "batch", context, batch)

    def request_overhead(self) -> float:
        """Seconds the serving path adds to a request's first token (0: not measured)."""
        return self.serving.get("request_seconds", 0.0)

    def prefill_factor(self) -> float:
        """How much longer a prefill step takes in a serving worker than in the profile's
        engine alone (1: not measured)."""
        return self.serving.get("prefill_factor", 1.0)

    def remote_overhead(self) -> float:
        """Seconds a prompt that crosses from a prefill worker adds beyond a local one's
        (the reservation and the prefill call; 0: not measured)."""
        return self.serving.get("remote_seconds", 0.0)

    def step_overhead(self, batch: int) -> float:
        """Seconds the serving path adds to a decode step of `batch` sequences (0: not measured)."""
        if not self.serving:
            return 0.0
        return max(0.0, self.serving["step_seconds"] + batch * self.serving["step_seconds_per_sequence"])

    def transfer_seconds(self, blocks: int) -> float:
        """KV of `blocks` blocks over the transport (0 without a transfer measurement)."""
        if not self.transfer or blocks <= 0:
            return 0.0
        return self.transfer["latency_seconds"] + (blocks - 1) * self.transfer["seconds_per_block"]


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), extrapolated from the end
    segments; one point: its value. Never below zero."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _grid(points: list[dict], outer: str, inner: str, at_outer: float, at_inner: float) -> float:
    """Interpolate in `inner` within each `outer` line of points, then across the lines."""
    lines: dict[float, list[tuple[float, float]]] = {}
    for p in points:
        lines.setdefault(p[outer], []).append((p[inner], p["seconds"]))
    keys = sorted(lines)
    values = []
    for key in keys:
        line = sorted(lines[key])
        values.append(_interpolate([x for x, _ in line], [y for _, y in line], at_inner))
    return _interpolate(keys, values, at_outer)


# -- measuring ---------------------------------------------------------------------------


def machine() -> dict:
    """The machine a profile was taken on."""
    import torch

    from pdserve.services.common.cpus import this_process

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(), "cpus_usable": this_process().usable,
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def model_source(engine, worker: WorkerConfig) -> dict:
    cfg = engine.model_config
    raw = (Path(worker.model) / "config.json").read_bytes()
    plan = engine.memory
    return {"model": Path(worker.model).name, "architecture": cfg.architecture, "config_sha256": hashlib.sha256(raw)
            .hexdigest(), "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "dtype": str(engine.runner.dtype).removeprefix("torch."), "weight_scheme": plan.weight_scheme,
            "weight_bytes": plan.weight_bytes, "kv_cache_dtype": plan.kv_cache_dtype,
            "kv_bytes_per_block": plan.kv_bytes_per_block, "block_size": plan.block_size,
            "num_blocks": plan.num_blocks, "max_model_len": plan.max_model_len}


class Prompts:
    """Random prompts, fresh each call (nothing shared by chance)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_TOKEN_ID, self.vocab) for _ in range(n)]


def measure_prefill(engine, prompts: Prompts, tokens: int, cached: int, repeats: int) -> dict | None:
    """A prefill point, or None when it does not fit the engine. The step's scheduled
    tokens are what the engine ran (a prefix the cache holds is not run again)."""
    from pdserve.engine import SamplingParams

    if tokens > engine.config.scheduler.max_num_batched_tokens or cached + tokens >= engine.max_model_len:
        return None
    if (cached + tokens + 1) // engine.memory.block_size + 2 > engine.memory.num_blocks:
        return None
    once = SamplingParams(max_tokens=1, temperature=0.0)
    times, ran = [], set()
    for run in range(repeats):
        prefix = prompts(cached)
        if cached:  # its blocks into the prefix cache
            _finish(engine, f"warm-{tokens}-{cached}-{run}", prefix + prompts(1), once)
        rid = f"prefill-{tokens}-{cached}-{run}"
        engine.add_request(rid, prefix + prompts(tokens), once)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        ran.add(engine.last_batch[1])
        _drain(engine, rid)
    scheduled = max(ran)
    return {"tokens": scheduled, "cached": cached + tokens - scheduled, **asdict(Point.of(times))}


def measure_decode(engine, prompts: Prompts, batch: int, context: int, steps: int, repeats: int) -> dict | None:
    """A decode point, or None when it does not fit the engine (sequences, KV pool)."""
    from pdserve.engine import SamplingParams

    cfg, plan = engine.config.scheduler, engine.memory
    length = context + steps + 8
    if batch > cfg.max_num_seqs or length > engine.max_model_len:
        return None
    if batch * -(-length // plan.block_size) > plan.num_blocks:
        return None
    params = SamplingParams(max_tokens=steps + 8 + batch * context // max(1, cfg.max_num_batched_tokens),
                            temperature=0.0, ignore_eos=True)
    medians = []
    for run in range(repeats):
        ids = [f"decode-{batch}-{context}-{run}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, prompts(context), params)
        try:
            for _ in range(10_000):  # every prompt prefilled: each step decodes one token per sequence
                engine.step()
                if engine.last_batch == (batch, batch):
                    break
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        finally:
            for rid in ids:
                engine.abort(rid)
    return {"batch": batch, "context": context, **asdict(Point.of(medians))}


def _finish(engine, rid: str, prompt: list[int], params) -> None:
    engine.add_request(rid, prompt, params)
    _drain(engine, rid)


def _drain(engine, rid: str) -> None:
    """Step until `rid` is done (it is alone in the engine)."""
    for _ in range(10_000):
        if not engine.has_unfinished():
            return
        engine.step()
    raise RuntimeError(f"profile: request {rid} did not finish")


def measure_transfer(bytes_per_block: int, blocks: int, repeats: int) -> dict:
    """Seconds per KV block streamed over ZeroMQ tcp on loopback (one frame a block,
    received into one buffer), and one block's latency alone (a round trip's half)."""
    import zmq

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    back_pull, back_push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        back = back_pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        back_push.connect(f"tcp://127.0.0.1:{back}")
        payload = bytes(bytes_per_block)
        sink = bytearray(bytes_per_block)

        def receive(count: int) -> None:
            for _ in range(count):
                pull.recv_into(sink)
            back_push.send(b"ok")

        def run(count: int) -> float:
            thread = threading.Thread(target=receive, args=(count,), daemon=True)
            thread.start()
            start = time.perf_counter()
            for _ in range(count):
                push.send(payload, copy=False)
            if not back_pull.poll(60_000):
                raise RuntimeError("profile: the transfer measurement got no answer in 60 s")
            back_pull.recv()
            elapsed = time.perf_counter() - start
            thread.join(10)
            return elapsed

        run(min(blocks, 16))  # connections up
        streams = [run(blocks) / blocks for _ in range(repeats)]
        singles = [run(1) for _ in range(max(repeats, 5))]
    finally:
        for s in (pull, push, back_pull, back_push):
            s.close(linger=0)
    stream = Point.of(streams)
    return {"transport": "zmq tcp loopback (raw frames, one per block)", "bytes_per_block": bytes_per_block,
            "seconds_per_block": stream.seconds, "seconds_per_block_low": stream.low,
            "seconds_per_block_high": stream.high, "latency_seconds": statistics.median(singles) / 2}


SERVING_PROMPT, SERVING_TOKENS, SERVING_BATCHES, SERVING_LONG_PROMPT = 64, 24, (1, 8, 32), 512


def measure_serving(profile: Profile, worker: WorkerConfig, repeats: int) -> dict:
    """The serving path's own cost (the module docstring): a one-worker cluster of
    `worker`'s flags, greedy streams of SERVING_PROMPT random tokens and SERVING_TOKENS
    outputs, alone (repeats times) and SERVING_BATCHES at once; each figure less what
    the profile says the engine's step takes."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from pdserve.launch.cluster import ClusterSpec, LaunchConfig
    from pdserve.launch.local import LocalCluster
    from pdserve.services.router.client import Client
    from pdserve.services.router.config import RouterConfig

    prompts = Prompts(profile.source["vocab_size"], worker.seed + 1)

    def cluster(launch: LaunchConfig) -> LocalCluster:
        # threshold 0: with a prefill worker, every prompt crosses
        return LocalCluster(ClusterSpec(RouterConfig(model=worker.model, port=0, log_level="WARNING",
                                                     local_prefill_threshold=0),
                                        replace(worker, log_level="WARNING"), launch))

    def one(client: Client, prompt: int = SERVING_PROMPT) -> tuple[float, list[float]]:
        start = time.perf_counter()
        times: list[float] = []
        for message in client.generate(prompts(prompt), max_tokens=SERVING_TOKENS, temperature=0.0,
                                       ignore_eos=True):
            times += [time.perf_counter()] * len(message.token_ids)
        return times[0] - start, [b - a for a, b in zip(times, times[1:])]

    with cluster(LaunchConfig(prefill=0, decode=0, mixed=1)) as mixed, Client(mixed.address, timeout=120) as client:
        one(client)  # warm
        alone = [one(client) for _ in range(max(3, repeats))]
        ttft = statistics.median(t for t, _ in alone)
        steps = {1: statistics.median(x for _, itl in alone for x in itl)}
        with ThreadPoolExecutor(max(SERVING_BATCHES)) as pool:
            for batch in SERVING_BATCHES[1:]:
                runs = list(pool.map(lambda _: one(client), range(batch)))
                steps[batch] = statistics.median(x for _, itl in runs for x in (itl[2:-2] or itl))
        long_ttft = statistics.median(one(client, SERVING_LONG_PROMPT)[0] for _ in range(max(3, repeats)))
    with cluster(LaunchConfig(prefill=1, decode=1)) as pd, Client(pd.address, timeout=120) as client:
        one(client)
        remote_ttft = statistics.median(one(client)[0] for _ in range(max(3, repeats)))
    context = SERVING_PROMPT + SERVING_TOKENS // 2
    extra = {b: max(0.0, t - profile.decode_seconds(b, context)) for b, t in steps.items()}
    slope, intercept = _line(list(extra), list(extra.values()))
    blocks = -(-SERVING_PROMPT // profile.source["block_size"])
    # TTFT = request + factor x prefill, at two prompt lengths: the factor is how much
    # slower a prefill runs in a serving worker than in the engine alone (its own gRPC
    # threads and the router take from it), the request the path's fixed cost
    short, long = profile.prefill_seconds(SERVING_PROMPT, 0), profile.prefill_seconds(SERVING_LONG_PROMPT, 0)
    factor = max(1.0, (long_ttft - ttft) / (long - short)) if long > short else 1.0
    request = max(0.0, ttft - factor * short)
    return {"request_seconds": request, "prefill_factor": factor, "measured_long_ttft_seconds": long_ttft,
            "remote_seconds": max(0.0, remote_ttft - ttft),
            "step_seconds": max(0.0, intercept), "step_seconds_per_sequence": max(0.0, slope),
            "measured_itl_seconds": {str(b): t for b, t in steps.items()}, "measured_ttft_seconds": ttft,
            "measured_remote_ttft_seconds": remote_ttft, "transfer_blocks": blocks}


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares: (slope, intercept)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return slope, my - slope * mx


def grids(config: ProfileConfig) -> tuple[Sequence[int], Sequence[int], Sequence[int], Sequence[int]]:
    if config.quick:
        return QUICK["tokens"], QUICK["cached"], QUICK["batches"], QUICK["contexts"]
    return PREFILL_TOKENS, PREFILL_CACHED, DECODE_BATCHES, DECODE_CONTEXTS


def take(config: ProfileConfig, report: Callable[[str], None] = print) -> Profile:
    """Measure (the module docstring) and return the profile."""
    from pdserve.engine import SamplingParams
    from pdserve.engine.engine import LLMEngine
    from pdserve.services.node import pin, prepare

    worker = config.worker
    unpinned = os.sched_getaffinity(0)  # the serving measurement's cluster is placed from this, as `pdserve up` is
    prepare(worker)
    engine = LLMEngine(worker.engine_config())
    try:
        repeats = 1 if config.quick else config.repeats
        prompts = Prompts(engine.model_config.vocab_size, worker.seed)
        tokens, cached, batches, contexts = grids(config)
        _finish(engine, "warm-up", prompts(64), SamplingParams(max_tokens=4, temperature=0.0))
        prefill = []
        for c in cached:
            if c % engine.memory.block_size:
                continue
            for n in tokens:
                point = measure_prefill(engine, prompts, n, c, repeats)
                if point is not None:
                    prefill.append(point)
                    report(f"prefill tokens={point['tokens']} cached={point['cached']} seconds={point['seconds']:.5f}")
        decode = []
        for ctx in contexts:
            for b in batches:
                point = measure_decode(engine, prompts, b, ctx, config.decode_steps, repeats)
                if point is not None:
                    decode.append(point)
                    report(f"decode batch={b} context={ctx} seconds={point['seconds']:.5f}")
        transfer = measure_transfer(engine.memory.kv_bytes_per_block, config.transfer_blocks, repeats)
        report(f"transfer seconds_per_block={transfer['seconds_per_block']:.3g} "
               f"latency_seconds={transfer['latency_seconds']:.3g}")
        source = {**model_source(engine, worker), "device": worker.device, "machine": machine(),
                  "flags": _flags(worker), "quick": config.quick, "taken_at": datetime.now(timezone.utc).isoformat(),
                  "pdserve": _version()}
    finally:
        engine.close()
    if not prefill or not decode:
        raise ValueError("profile: no prefill or no decode point fits this engine (--num-blocks, --max-model-len, "
                         "--max-num-batched-tokens, --max-num-seqs)")
    profile = Profile(source, prefill, decode, transfer)
    if config.serving:
        pin(unpinned)
        serving = measure_serving(profile, worker, repeats)
        report(f"serving request_seconds={serving['request_seconds']:.4f} remote_seconds={serving['remote_seconds']:.4f} "
               f"prefill_factor={serving['prefill_factor']:.3f} "
               f"step_seconds={serving['step_seconds']:.5f} "
               f"step_seconds_per_sequence={serving['step_seconds_per_sequence']:.6f}")
        profile = Profile(source, prefill, decode, transfer, serving=serving)
    return profile


def _flags(worker: WorkerConfig) -> dict:
    """The engine's flags as given (the ones that shape a step's cost)."""
    names = ("dtype", "quantization", "kv_cache_dtype", "block_size", "num_blocks", "kv_cache_memory",
             "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enforce_eager", "decode_capture_sizes",
             "attention_backend", "torch_threads", "cpu_affinity", "device", "enable_prefix_caching")
    return {n: _plain(getattr(worker, n)) for n in names if hasattr(worker, n)}


def _plain(value: object) -> object:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list, set, frozenset)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pdserve")
    except Exception:  # noqa: BLE001 (a source tree without its metadata)
        return "unknown"


def run(config: ProfileConfig) -> int:
    """`pdserve profile`: measure, write, print the file's path last."""
    profile = take(config)
    profile.write(config.output)
    print(f"profile {config.output} prefill_points={len(profile.prefill)} decode_points={len(profile.decode)}")
    return 0

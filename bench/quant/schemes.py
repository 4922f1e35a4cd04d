"""Quantization benchmark (issue 20): what each weight scheme and KV dtype buys in memory,
speed and transfer bytes, against full precision, in one run.

    python -m pdserve.bench.quant.schemes                 # ~100M Llama, 3 repetitions (CPU: ~10 minutes)
    python -m pdserve.bench.quant.schemes --quick         # tiny model, 2 repetitions (well under a minute)
    python -m pdserve.bench.quant.schemes --device cuda   # one GPU, bf16 baseline, ~1B Llama (under 5 minutes)
    python -m pdserve.bench.quant.schemes --transfer-only # the two KV transfer parts alone

    bench.engine.offline's random Llama (fp32 on a CPU, bf16 on a GPU), saved once
      configurations: base (full precision), int8, int4, fp8, fp4 weights; base
      weights with each FP8 KV dtype; int8 weights with fp8_e4m3 KV
    one engine per configuration, built once, every one with the same KV budget
      (QuantBenchConfig.kv_cache_memory bytes): weight bytes and KV blocks are the engine's own
      MemoryPlan (llm.engine.memory), exact, not timed
    for each repetition r (bench/common/repeat.py: every configuration once, in turn):
      throughput    bench.engine.offline's workload for r (seeded; its own prompts each
                    repetition), greedy, EOS ignored: output tokens / wall time
      decode step   decode_batch prompts prefilled in one step, then the wall time of
                    each of the next decode_steps steps (decode only); the median
    GEMMs           one linear layer per scheme at the model's shapes: decode-sized
                    inputs (the decode step's rows, the workload's widest batch) and a
                    full prefill step's, against the base dtype's F.linear
    KV transfer     bench/quant/cluster.py: per KV dtype a 1P+1D cluster (router, prefill
                    and decode worker processes, the launcher's ZeroMQ connector with
                    CURVE), every prompt prefilled remotely: KV bytes per prompt token
                    from the workers' Stats, the prefill worker's transfer time
                    (kv_transfer_seconds) and the router's TTFT; and
                    bench/quant/transfer.py: the transport alone, a prompt's KV from a
                    prefill engine to a decode engine in this process

Ratios are taken within a repetition and reported as the median [min, max]. On a CPU
the int8 and int4 kernels take bf16 activations (W8A16 / W4A16, engine/quant/linear.py);
fp8 runs torch._scaled_mm, which has no fast CPU kernel; fp4 dequantizes every weight on
every call (memory only), so its throughput is skipped on a CPU unless
--fp4-throughput is given (its decode step time is still measured).

The last line:
`weight_bytes_ratio_int8=A kv_blocks_ratio_fp8=B transfer_bytes_ratio_fp8=C throughput_ratio_int8=D`
A = base weight bytes / int8's, B = fp8_e4m3 KV blocks / base KV blocks (same budget),
C = base KV bytes shipped / fp8_e4m3's (the same prompts through the 1P+1D clusters, the
decode workers' Stats), D = int8 throughput / base's. With --transfer-only it is
`transfer_bytes_ratio_fp8=C` alone.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench.common.entry import overridden, parse
from pdserve.bench.common.machine import machine_load
from pdserve.bench.engine.workload import Request, make_warmup, make_workload, output_tokens
from pdserve.bench.quant.config import GPU, QUICK, QuantBenchConfig, Variant
from pdserve.bench.common.random_model import FIRST_REGULAR_TOKEN, ModelSpec, save_random_model, temporary_dir
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, fmt, median
from pdserve.services.common.flags import flag

# -- one engine per variant -------------------------------------------------------------


def load_engine(model_dir: Path, variant: Variant, cfg: QuantBenchConfig):
    from pdserve.engine import LLM

    return LLM(model=str(model_dir), quantization=variant.quantization, kv_cache_dtype=variant.kv_cache_dtype,
               kv_cache_memory=cfg.kv_cache_memory, block_size=cfg.block_size, enable_prefix_caching=False,
               max_num_batched_tokens=cfg.max_num_batched_tokens, dtype=cfg.dtype, device=cfg.device)


@dataclass(frozen=True)
class Pass:
    """One variant's measurements in one repetition."""

    throughput: float  # output tokens / s (nan: skipped)
    decode_step_s: float  # median wall time of a decode-only step


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_workload(llm, requests: Sequence[Request], device: str) -> float:
    from pdserve.engine import SamplingParams

    params = [SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    sync(device)
    start = time.perf_counter()
    outs = llm.generate([list(r.prompt) for r in requests], params)
    sync(device)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != output_tokens(requests):
        raise RuntimeError(f"{produced} tokens produced, {output_tokens(requests)} asked")
    return produced / wall


def decode_step_time(llm, cfg: QuantBenchConfig, tag: str) -> float:
    """`decode_batch` prompts prefilled in one step, then the median of the next
    `decode_steps` steps, each decoding one token of every sequence."""
    from pdserve.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=cfg.decode_steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(cfg.decode_batch):
        prompt = [FIRST_REGULAR_TOKEN + (7 * i + 13 * j) % (cfg.model.vocab_size - FIRST_REGULAR_TOKEN)
                  for j in range(cfg.decode_prompt)]
        engine.add_request(f"{tag}-decode-{i}", prompt, params)
    engine.step()  # the prefill, and every first token
    times = []
    while engine.has_unfinished():
        sync(cfg.device)
        start = time.perf_counter()
        engine.step()
        sync(cfg.device)
        times.append(time.perf_counter() - start)
    if len(times) != cfg.decode_steps:
        raise RuntimeError(f"decode: {len(times)} steps after the prefill, expected {cfg.decode_steps}")
    return median(times)


def measure(llm, variant: Variant, cfg: QuantBenchConfig, workload: Sequence[Request], rep: int) -> Pass:
    start = time.perf_counter()
    tput = run_workload(llm, workload, cfg.device) if cfg.throughput_of(variant) else float("nan")
    result = Pass(tput, decode_step_time(llm, cfg, f"r{rep}"))
    log(f"  {variant.name}: {fmt(result.throughput)} tok/s, decode step {1e3 * result.decode_step_s:.1f} ms "
        f"({time.perf_counter() - start:.1f} s)")
    return result


# -- GEMMs ------------------------------------------------------------------------------


def gemm_shapes(model: ModelSpec, rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(M, K, N) of the fused qkv, gate_up and down projections."""
    h = model.hidden_size
    layers = [(h, model.q_size + 2 * model.kv_size), (h, 2 * model.intermediate_size), (model.intermediate_size, h)]
    return [(m, k, n) for m in rows for k, n in layers]


def time_call(fn: Callable[[], object], device: str, min_seconds: float) -> float:
    """Best of 3 rounds of the mean time of one call (after a warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(3):
        sync(device)
        start, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds / 3:
                break
        best = min(best, elapsed / calls)
    return best


def gemm_times(shape: tuple[int, int, int], methods: Sequence[str], cfg: QuantBenchConfig) -> dict[str, float]:
    """Seconds of one linear of `shape` in the base dtype and in each scheme."""
    from pdserve.engine.quant.config import online_scheme
    from pdserve.engine.quant.linear import QuantLinear

    m, k, n = shape
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator().manual_seed(m * 7919 + k * 31 + n)
    weight = (torch.randn(n, k, generator=gen) * 0.02).to(cfg.device, dtype)
    x = torch.randn(m, k, generator=gen).to(cfg.device, dtype)
    out = {"base": time_call(lambda: F.linear(x, weight), cfg.device, cfg.gemm_min_seconds)}
    with torch.inference_mode():
        for method in methods:
            layer = QuantLinear.from_float(weight, online_scheme(method))
            layer.prepare()
            out[method] = time_call(lambda: layer(x), cfg.device, cfg.gemm_min_seconds)
    return out


# -- report -----------------------------------------------------------------------------


def log(line: str = "") -> None:
    print(line, flush=True)


@contextmanager
def phase(name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    log(f"[phase] {name}: {time.perf_counter() - start:.1f} s")


@dataclass
class Report:
    memory: dict[str, object] = field(default_factory=dict)  # variant name -> MemoryPlan
    passes: dict[str, list[Pass]] = field(default_factory=dict)

    def ratio(self, name: str, attr: str, invert: bool = False) -> Ratio:
        mine = [getattr(p, attr) for p in self.passes[name]]
        base = [getattr(p, attr) for p in self.passes["base"]]
        return Ratio.paired(base, mine) if invert else Ratio.paired(mine, base)


def print_memory(report: Report, cfg: QuantBenchConfig) -> None:
    base = report.memory["base"]
    log(f"\nmemory (KV budget {cfg.kv_cache_memory} bytes for every engine; weight and KV ratios vs base {cfg.dtype})")
    log(f"{'variant':<14} {'weights':>12} {'weight bytes':>14} {'/ base':>7} {'KV dtype':>14} {'bytes/token':>12} "
        f"{'KV blocks':>10} {'x base':>7}")
    for v in cfg.variants:
        plan = report.memory[v.name]
        log(f"{v.name:<14} {plan.weight_scheme:>12} {plan.weight_bytes:>14} {base.weight_bytes / plan.weight_bytes:>7.3f} "
            f"{plan.kv_cache_dtype:>14} {plan.kv_bytes_per_token:>12} {plan.num_blocks:>10} "
            f"{plan.num_blocks / base.num_blocks:>7.3f}")


def print_speed(report: Report, cfg: QuantBenchConfig) -> None:
    log(f"\nspeed (medians over {cfg.repeats} repetitions [min, max]; ratios per repetition vs base; decode step: "
        f"{cfg.decode_batch} sequences; weights read per decode step / its time)")
    for v in cfg.variants:
        passes = report.passes[v.name]
        tput = Ratio.of([p.throughput for p in passes])
        step = Ratio.of([p.decode_step_s * 1e3 for p in passes])
        gbps = report.memory[v.name].weight_bytes / median(p.decode_step_s for p in passes) / 1e9
        tput_text = f"{tput}" if cfg.throughput_of(v) else "skipped (fp4 on a CPU: --fp4-throughput)"
        log(f"{v.name:<14} throughput tok/s {tput_text}")
        log(f"{'':<14} decode step ms   {step}  ({gbps:.2f} GB/s of weights)")
        if v.name != "base":
            log(f"{'':<14} throughput x base {report.ratio(v.name, 'throughput')}   decode step: base / this "
                f"{report.ratio(v.name, 'decode_step_s', invert=True)}")


def print_gemms(cfg: QuantBenchConfig) -> None:
    methods = [v.quantization for v in cfg.variants if v.quantization and v.kv_cache_dtype == "auto"]
    # decode-sized: the decode step's batch and the workload's widest; prefill-sized: a full step
    rows = sorted({cfg.decode_batch, cfg.workload.num_requests, cfg.max_num_batched_tokens})
    log(f"\nGEMM, one linear layer (ms; speed-up = base {cfg.dtype} F.linear time / the scheme's)")
    for shape in gemm_shapes(cfg.model, rows):
        times = gemm_times(shape, methods, cfg)
        cells = "  ".join(f"{name} {1e3 * t:8.3f} ({times['base'] / t:5.2f}x)" for name, t in times.items())
        log(f"[{shape[0]:>4} x {shape[1]:>4}] @ [{shape[1]:>4} x {shape[2]:>5}]  {cells}")


# -- the run ----------------------------------------------------------------------------


def run(cfg: QuantBenchConfig) -> str:
    """The whole benchmark (or its transfer parts); returns the last line."""
    torch.manual_seed(cfg.seed)
    m = cfg.model
    log(f"model: llama hidden={m.hidden_size} layers={m.num_layers} heads={m.num_heads} kv_heads={m.num_kv_heads} "
        f"intermediate={m.intermediate_size} vocab={m.vocab_size} params={m.total_params / 1e6:.1f}M base {cfg.dtype}")
    log(f"torch {torch.__version__} device={cfg.device} threads={torch.get_num_threads()} repeats={cfg.repeats} "
        f"{machine_load()}")
    with temporary_dir("pdserve-bench-quant-") as model_dir:
        with phase("save random checkpoint"):
            save_random_model(cfg.model, model_dir, cfg.seed)
        report = None if cfg.transfer_only else run_engines(model_dir, cfg)
        return last_line(report, run_transfers(model_dir, cfg))


def run_engines(model_dir: Path, cfg: QuantBenchConfig) -> Report:
    """Memory, speed and GEMMs: one engine per variant, interleaved repetitions."""
    workloads = [make_workload(cfg.workload, cfg.model.vocab_size, rep) for rep in range(cfg.repeats)]
    warmup = make_warmup(cfg.model.vocab_size, cfg.seed)
    log(f"workload: {cfg.workload.num_requests} requests, prompt_len {cfg.workload.prompt_len} new_tokens "
        f"{cfg.workload.new_tokens}, {output_tokens(workloads[0])} output tokens (repetition 1)")
    report = Report()
    with phase(f"load {len(cfg.variants)} engines and warm them up"):
        engines = {}
        for v in cfg.variants:
            engines[v.name] = load_engine(model_dir, v, cfg)
            report.memory[v.name] = engines[v.name].engine.memory
            run_workload(engines[v.name], warmup, cfg.device)
    systems = {v.name: (lambda rep, v=v: measure(engines[v.name], v, cfg, workloads[rep], rep)) for v in cfg.variants}
    with phase(f"{cfg.repeats} interleaved repetitions of {len(systems)} engines"):
        report.passes = interleaved(systems, cfg.repeats, log)
    del engines, systems
    gc.collect()
    print_memory(report, cfg)
    print_speed(report, cfg)
    with phase("GEMMs"):
        print_gemms(cfg)
    return report


def run_transfers(model_dir: Path, cfg: QuantBenchConfig):
    """The KV transfer through 1P+1D clusters, then the transport alone (an engine
    pair); the same prompt length, so the same bytes per prompt (checked). The
    clusters' report."""
    from pdserve.bench.quant import cluster as quant_cluster, transfer as quant_transfer

    with phase("KV transfer through 1P+1D clusters"):
        cluster = quant_cluster.run(model_dir, cfg, log)
    with phase("KV transfer, engine pair"):
        pair = quant_transfer.run(model_dir, cfg, log)
    for kv, shipped in pair.bytes.items():
        if cluster.bytes(kv) != cfg.cluster_prompts * shipped:
            raise RuntimeError(f"{kv}: the cluster shipped {cluster.bytes(kv)} bytes for {cfg.cluster_prompts} "
                               f"prompts, the engine pair {shipped} for one")
    return cluster


def last_line(report: Report | None, cluster) -> str:
    c = cluster.bytes("auto") / cluster.bytes("fp8_e4m3")
    if report is None:
        return f"transfer_bytes_ratio_fp8={c:.3f}"
    base, int8, fp8 = (report.memory[n] for n in ("base", "int8", "kv_fp8_e4m3"))
    a = base.weight_bytes / int8.weight_bytes
    b = fp8.num_blocks / base.num_blocks
    d = report.ratio("int8", "throughput").median
    return f"weight_bytes_ratio_int8={a:.3f} kv_blocks_ratio_fp8={b:.3f} transfer_bytes_ratio_fp8={c:.3f} " \
           f"throughput_ratio_int8={fmt(d)}"


@dataclass(frozen=True)
class QuantFlags:
    quick: bool = flag(False, "tiny model, 2 repetitions (the smoke test)")
    device: str = flag("cpu", "cpu, or cuda: the GPU mode (bf16 base, ~1B model)")
    repeats: int | None = flag(None, "interleaved repetitions (3; --quick 2)")
    seed: int = flag(0, "seed of the model and the workload")
    fp4_throughput: bool = flag(False, "run fp4 through the workload on a CPU too")
    transfer_only: bool = flag(False, "only the KV transfer parts (1P+1D clusters, engine pair); last line: C alone")


def config_from(flags: QuantFlags) -> QuantBenchConfig:
    cuda = flags.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {flags.device}: torch sees no CUDA device here (torch {torch.__version__}); "
                         "the GPU mode needs one")
    if not cuda and flags.device != "cpu":
        raise ValueError(f"--device: cpu or cuda, got {flags.device!r}")
    if flags.repeats is not None and flags.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    base = GPU if cuda else (QUICK if flags.quick else QuantBenchConfig())
    if cuda and flags.quick:
        base = replace(QUICK, device=flags.device, dtype="bfloat16")
    return overridden(base, flags)


def parse_args(argv: Sequence[str] | None) -> QuantBenchConfig:
    return parse(QuantFlags, argv, "python -m pdserve.bench.quant.schemes", __doc__, config_from)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    start = time.perf_counter()
    line = run(cfg)
    log(f"benchmark wall time: {time.perf_counter() - start:.1f} s")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

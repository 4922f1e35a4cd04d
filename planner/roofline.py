"""Profiles of machines this one is not: a model of published size on a GPU of published
FLOPs and memory bandwidth, from the roofline, for planning at scale (estimates).

    python -m pdserve.planner.roofline [--requests N]     # the table in docs/benchmarks.md

A step's time is the larger of its compute (2 x parameters x tokens, plus attention's
4 x layers x hidden x tokens x context, at `mfu` of the GPU's dense FLOPs) and its
memory traffic (the weights once, plus the KV it reads, at `mbu` of the bandwidth),
plus a fixed `overhead` per step (the launch and the framework). A worker is `tp` GPUs
in tensor parallel, ideally: FLOPs, bandwidth and memory times `tp`. KV crosses between
workers at `link` bytes per second. These are the usual first-order estimates (the
figures vendors publish, not measured here): the table says so.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.planner.profile import FORMAT, Profile
from pdserve.services.common.flags import add_flags, check, flag, from_namespace

PREFILL_TOKENS = (16, 64, 256, 1024, 4096, 8192)
PREFILL_CACHED = (0, 1024, 4096, 16384)
DECODE_BATCHES = (1, 8, 32, 64, 128, 256, 512)
DECODE_CONTEXTS = (256, 1024, 4096, 16384)


@dataclass(frozen=True)
class Gpu:
    name: str
    flops: float  # dense bf16/fp16 FLOP/s, as published
    bandwidth: float  # HBM bytes/s
    memory: float  # bytes
    link: float = 50e9  # bytes/s between workers for KV (400 Gb/s InfiniBand)


@dataclass(frozen=True)
class ModelSize:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int


GPUS = {
    "H100": Gpu("H100 SXM", 989e12, 3.35e12, 80e9),
    "H200": Gpu("H200 SXM", 989e12, 4.8e12, 141e9),
    "A100": Gpu("A100 80GB SXM", 312e12, 2.04e12, 80e9),
    "L40S": Gpu("L40S", 362e12, 0.864e12, 48e9, link=25e9),
}
MODELS = {
    "llama-3-8b": ModelSize("Llama 3 8B", 8.03e9, 32, 4096, 8, 128),
    "llama-3-70b": ModelSize("Llama 3 70B", 70.6e9, 80, 8192, 8, 128),
    "qwen2.5-32b": ModelSize("Qwen2.5 32B", 32.8e9, 64, 5120, 8, 128),
}


def roofline_profile(model: ModelSize, gpu: Gpu, tp: int = 1, dtype_bytes: int = 2, mfu: float = 0.5,
                     mbu: float = 0.7, overhead: float = 0.004, block_size: int = 16,
                     memory_utilization: float = 0.9) -> Profile:
    """The profile (profile.py's format) of one worker of `tp` x `gpu` serving `model`."""
    if tp < 1:
        raise ValueError(f"tp: must be >= 1, got {tp}")
    flops, bandwidth = gpu.flops * tp * mfu, gpu.bandwidth * tp * mbu
    weights = model.params * dtype_bytes
    kv_per_token = 2 * model.layers * model.kv_heads * model.head_dim * dtype_bytes
    free = gpu.memory * tp * memory_utilization - weights
    if free <= kv_per_token * block_size:
        raise ValueError(f"{model.name} ({weights / 1e9:.0f} GB) does not fit {tp} x {gpu.name}")

    def prefill_step(tokens: int, cached: int) -> float:
        """`tokens` new tokens attending to `cached` ones and to each other (half, causal)."""
        compute = (2 * model.params * tokens + 4 * model.layers * model.hidden * tokens * (cached + tokens / 2)) / flops
        memory = (weights + kv_per_token * (cached + tokens)) / bandwidth
        return overhead + max(compute, memory)

    prefill = [{"tokens": t, "cached": c, "seconds": prefill_step(t, c), "low": 0, "high": 0, "runs": 0}
               for c in PREFILL_CACHED for t in PREFILL_TOKENS]
    decode = []
    for ctx in DECODE_CONTEXTS:
        for b in DECODE_BATCHES:
            compute = (2 * model.params * b + 4 * model.layers * model.hidden * b * ctx) / flops
            memory = (weights + kv_per_token * ctx * b) / bandwidth
            decode.append({"batch": b, "context": ctx, "seconds": overhead + max(compute, memory), "low": 0,
                           "high": 0, "runs": 0})
    block = kv_per_token * block_size
    source = {"model": model.name, "estimate": "roofline", "gpu": gpu.name, "tp": tp, "mfu": mfu, "mbu": mbu,
              "num_blocks": int(free // block), "block_size": block_size, "kv_bytes_per_block": block,
              "weight_bytes": weights, "machine": {"gpu": gpu.name, "cpu": None, "isa": None},
              "flags": {"max_num_batched_tokens": 8192, "max_num_seqs": 512}}
    transfer = {"transport": f"{gpu.link / 1e9:g} GB/s link (estimate)", "bytes_per_block": block,
                "seconds_per_block": block / gpu.link, "latency_seconds": 20e-6}
    return Profile(source, prefill, decode, transfer, FORMAT)


# (model, gpu, tp, rate req/s, input, output, TTFT ms, TPOT ms)
SCENARIOS = (
    ("llama-3-8b", "H100", 1, 40, 2048, 256, 1000, 50),
    ("llama-3-8b", "L40S", 1, 10, 2048, 256, 1000, 50),
    ("qwen2.5-32b", "H200", 1, 10, 4096, 512, 2000, 60),
    ("llama-3-70b", "H100", 4, 10, 4096, 512, 2000, 60),
    ("llama-3-70b", "H200", 2, 10, 4096, 512, 2000, 60),
)


@dataclass(frozen=True)
class TableFlags:
    requests: int = flag(600, "requests simulated per split")
    max_workers: int = flag(12, "largest split considered")

    def __post_init__(self) -> None:
        check(self.requests >= 10, "requests", "must be >= 10", self.requests)
        check(self.max_workers >= 1, "max_workers", "must be >= 1", self.max_workers)


def main(argv: list[str] | None = None) -> int:
    from pdserve.planner.plan import SloPlanConfig, search
    from pdserve.planner.simulator import Limits

    parser = argparse.ArgumentParser(prog="python -m pdserve.planner.roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, TableFlags)
    try:
        args = from_namespace(TableFlags, parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))
    print("| model | workers of | traffic | targets (90 %) | planned split | TTFT p50 / p90 | TPOT p50 / p90 | "
          "goodput per worker |")
    print("|---|---|---|---|---|---|---|---|")
    for name, gpu_name, tp, rate, inp, out, ttft, tpot in SCENARIOS:
        profile = roofline_profile(MODELS[name], GPUS[gpu_name], tp)
        limits = Limits(8192, 512, profile.source["num_blocks"], 16)
        config = SloPlanConfig(profile="(roofline)", rate=rate, input_len=inp, slo_ttft_ms=ttft, slo_tpot_ms=tpot,
                               max_workers=args.max_workers, requests=args.requests, length_spread=0.25,
                               local_prefill_thresholds=(0, 512))
        chosen, tried = search(profile, config, limits, out)
        best = chosen or max(tried, key=lambda c: (c.figures.met, c.figures.goodput))
        f = best.figures
        split = best.shape.label() + (f" (threshold {best.shape.local_prefill_threshold})" if best.shape.prefill
                                      else "")
        print(f"| {MODELS[name].name} | {tp} x {GPUS[gpu_name].name} | {rate} req/s, {inp} + {out} tokens | "
              f"TTFT {ttft} ms, TPOT {tpot} ms | {split if chosen else 'none; closest ' + split} | "
              f"{f.ttft_p50 * 1000:.0f} / {f.ttft_p90 * 1000:.0f} ms | {f.tpot_p50 * 1000:.1f} / "
              f"{f.tpot_p90 * 1000:.1f} ms | {f.goodput / best.workers:.2f} req/s |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

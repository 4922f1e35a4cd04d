"""KV offload benchmark (issue 36): the multi-turn chat workload with the device pool
holding about a quarter of the conversations' KV, tiers below it off vs on.

    python -m pdserve.bench.offload              # a 12M-parameter random Llama, a few minutes on 2 cores
    python -m pdserve.bench.offload --quick      # the embedded model, small, under a minute
    python -m pdserve.bench.offload --no-cluster --no-disk --no-policies   # the engine comparison alone
    python -m pdserve.bench.offload --no-engine --no-cluster                # disk tier and policies alone

What runs (bench/offload/tiers.py), every comparison interleaved (A B A B), each
repetition on its own seeded conversations (bench/serving/multiturn.py: 5-10 turns,
each resending the whole history, a think time between turns, more conversations in
flight than the device pool holds):

  1. one engine, in this process: device pool alone vs a host tier holding every block
  2. a 1P+1D cluster (router and workers as processes, gRPC): the same, per worker
  3. a disk tier alone (host 0), per block size: a disk hit's cost (onload seconds
     per block), the page cache warm and kept cold (files fsynced, their pages dropped
     every 20 ms), against recomputing a block (prefill seconds per block)
  4. the eviction policies (lru, arc) on one trace, the host tier too small for it

Printed: the machine (isa, cpus, load), the model, the sizing, a line per run (TTFT
p50/p99, output tokens/s, prefix-cached share, tier hit rates), the ratios as median
(min, max, k), and last:

    offload_ttft_p50_ratio=X offload_throughput_ratio=Y host_hit_rate=Z

from the one-engine comparison (nan with --no-engine; X: TTFT p50 off/on, Y: output throughput on/off, Z:
the host tier's hit rate over the blocks that missed the device pool). The exit
status is 1 when a report does not hold together (a failed request, tier hits with
the tiers off, more blocks onloaded than found), never because of a speed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from pdserve.bench.common.entry import compare_main, parse
from pdserve.bench.common.random_model import temporary_dir
from pdserve.bench.offload.tiers import (
    OffloadConfig,
    Report,
    cluster_off_vs_on,
    conversations_for,
    disk_alone,
    isa,
    last_line,
    policies,
    served,
    size,
    tiers_off_vs_on,
)
from pdserve.bench.serving.run import write_json
from pdserve.services.common.flags import flag

# 12 conversations of 5 turns, answers of 2-3 tokens: every tier and policy runs, for the
# fewest engine steps (seeded: the device pool comes out at 25 % of the KV, above its floor)
QUICK = OffloadConfig(workload=replace(OffloadConfig.workload, num_requests=12, turns=(5, 5), prompt_tokens=(24, 40),
                                       output_tokens=(2, 3), think_time=0.1),
                      request_rate=20.0, embedded=True, disk_block_sizes=(16,), repeats=2)


@dataclass(frozen=True)
class OffloadFlags:
    quick: bool = flag(False, "the embedded model, 12 short conversations, under a minute (explicit flags still win)")
    conversations: int | None = flag(None, f"conversations per repetition ({OffloadConfig.workload.num_requests})")
    turns: tuple[int, int] | None = flag(None, "MIN MAX turns per conversation")
    prompt_tokens: tuple[int, int] | None = flag(None, "MIN MAX tokens of each new user message")
    output_tokens: tuple[int, int] | None = flag(None, "MIN MAX tokens of each answer")
    think_time: float | None = flag(None, "mean seconds between an answer and the next turn")
    concurrency: int | None = flag(None, "conversations in flight (0: all)")
    request_rate: float | None = flag(None, f"conversations started per second ({OffloadConfig.request_rate:g})")
    model: str | None = flag(None, "model directory (default: a seeded random 12M-parameter Llama)")
    embedded: bool | None = flag(None, "the embedded model (tiny: recomputing is cheap)")
    block_size: int | None = flag(None, f"tokens per KV block ({OffloadConfig.block_size})")
    device_fraction: float | None = flag(None, f"device pool, of the conversations' KV ({OffloadConfig.device_fraction})")
    disk_block_sizes: tuple[int, ...] | None = flag(None, "block sizes of the disk-alone mode, e.g. 16,64")
    disk_dir: str | None = flag(None, "where the disk tier's directories are made (default: the temporary directory)")
    repeats: int | None = flag(None, f"interleaved repetitions ({OffloadConfig.repeats})")
    engine: bool = flag(True, "the one-engine comparison (the last line's figures: nan without it)")
    cluster: bool = flag(True, "the 1P+1D cluster comparison")
    disk: bool = flag(True, "the disk-tier-alone mode")
    policies: bool = flag(True, "the eviction policies' comparison")
    torch_threads: int = flag(OffloadConfig.torch_threads, "torch threads of each engine / worker")
    seed: int = flag(OffloadConfig.seed, "seed of the conversations (repetition k: seed + k) and the model")
    json: str | None = flag(None, "write the figures and every run's summary to this file")


def config_from(f: OffloadFlags) -> tuple[OffloadConfig, str | None]:
    base = QUICK if f.quick else OffloadConfig()
    given = {"num_requests": f.conversations, "turns": f.turns, "prompt_tokens": f.prompt_tokens,
             "output_tokens": f.output_tokens, "think_time": f.think_time}
    workload = replace(base.workload, **{k: v for k, v in given.items() if v is not None})
    top = {"concurrency": f.concurrency, "request_rate": f.request_rate, "model": f.model, "embedded": f.embedded,
           "block_size": f.block_size, "device_fraction": f.device_fraction, "disk_block_sizes": f.disk_block_sizes,
           "repeats": f.repeats, "disk_parent": f.disk_dir}
    cfg = replace(base, workload=workload, engine=f.engine, cluster=f.cluster, disk=f.disk, policies=f.policies,
                  torch_threads=f.torch_threads, seed=f.seed, **{k: v for k, v in top.items() if v is not None})
    return cfg, f.json


def run(cfg: OffloadConfig, json_path: str | None) -> tuple[str, list[str]]:
    from pdserve.bench.cluster.clusters import ModelShape, save_model
    from pdserve.bench.common.machine import machine_load
    from pdserve.engine.config import DEFAULT_MODEL

    print(f"isa={isa()} {machine_load()}", flush=True)
    with temporary_dir("pdserve-bench-offload-") as tmp:
        if cfg.model or cfg.embedded:
            model_dir, what = cfg.model or DEFAULT_MODEL, "given" if cfg.model else "embedded"
        else:
            shape = cfg.shape or ModelShape()
            save_model(shape, tmp / "model", cfg.seed)
            model_dir, what = str(tmp / "model"), f"random Llama {shape}"
        model = served(model_dir)
        w = cfg.workload
        print(f"model: {what} ({model_dir}), fp32, cpu, torch_threads={cfg.torch_threads}")
        print(f"workload: multiturn, {w.num_requests} conversations of {w.turns[0]}-{w.turns[1]} turns, "
              f"{w.prompt_tokens[0]}-{w.prompt_tokens[1]} new tokens a turn, {w.output_tokens[0]}-{w.output_tokens[1]} "
              f"tokens an answer, think time {w.think_time:g}s (exponential), {cfg.request_rate:g} conversations/s, "
              f"{cfg.concurrency or 'all'} in flight, greedy, ignore_eos, seed {cfg.seed} + repetition")
        sizing = size(conversations_for(cfg, model, 0), cfg.block_size, cfg.device_fraction, model_dir)
        print(f"sizing: {sizing.describe()}", flush=True)
        report = Report(lambda line: print(line, flush=True))
        if cfg.engine:
            tiers_off_vs_on(cfg, model, sizing, report)
        if cfg.cluster:
            cluster_off_vs_on(cfg, model, sizing, report)
        if cfg.disk:
            disk_alone(cfg, model, report)
        if cfg.policies:
            policies(cfg, model, sizing, report)
    if json_path:
        write_json(json_path, {"config": asdict(cfg), "figures": _figures_json(report.figures)})
        print(f"report written to {json_path}")
    return last_line(report.figures), report.problems


def _figures_json(figures: dict) -> dict:
    out = {}
    for name, value in figures.items():
        if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            out[name] = {k: [{"label": o.label, "summary": o.run.summary.to_dict(), "host_hit_rate": o.host_hit_rate,
                              "disk_hit_rate": o.disk_hit_rate, "onloaded_blocks": o.onloaded_blocks}
                             for o in v] for k, v in value.items()}
        elif hasattr(value, "median"):
            out[name] = asdict(value)
        else:
            out[name] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    cfg, json_path = parse(OffloadFlags, argv, "python -m pdserve.bench.offload", __doc__, config_from)
    return compare_main("bench.offload", lambda: run(cfg, json_path))


if __name__ == "__main__":
    sys.exit(main())

"""The speculative-decoding benchmark (bench.spec.methods, bench.spec.gpu): its settings
and presets, one closed loop per method, workload and concurrency, and the report
(bench/spec/report.py). What it measures and why: bench/spec/methods.py."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from pdserve.bench.common.entry import ReportFlags, compare_main, overridden, parse
from pdserve.bench.common.machine import machine_load
from pdserve.bench.common.repeat import rotated
from pdserve.bench.common.stats import median
from pdserve.bench.spec.report import (Cell, Run, acceptance_curves, acceptance_summary, analyse, head_lines, last_line,
                                       table)
from pdserve.bench.spec.workloads import WORKLOADS, SpecRequest, draw_functions, make_requests
from pdserve.engine.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.speculator import SpecStats
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.common.flags import flag

METHODS = ("off", "ngram", "draft_model", "eagle3")
DEFAULT_EAGLE_MODEL = DEFAULT_MODEL + "-eagle3"  # scripts/train_eagle_head.py's head of the embedded model


@dataclass(frozen=True)
class SpecBenchConfig:
    model: str = DEFAULT_MODEL
    draft_model: str = DEFAULT_DRAFT_MODEL
    eagle_model: str | None = None  # None: DEFAULT_EAGLE_MODEL when model is the embedded one
    tokenizer: str | None = None  # None: the model's own
    methods: tuple[str, ...] = METHODS
    workloads: tuple[str, ...] = WORKLOADS
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    requests_per_slot: int = 2  # a closed loop at concurrency c runs max(min_requests, 2c) requests
    min_requests: int = 8
    max_tokens: int = 96
    function_tokens: tuple[int, int] = (96, 400)  # size of the held-out functions drawn
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None  # None: the engine's default
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    measure_payoff: bool | None = None  # None: the engine's default
    repeats: int = 3
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    threads: int | None = None  # torch threads (None: torch's default)

    def __post_init__(self) -> None:
        for name, values, known in (("methods", self.methods, METHODS), ("workloads", self.workloads, WORKLOADS)):
            unknown = [v for v in values if v not in known]
            if unknown or not values:
                raise ValueError(f"--{name}: a comma-separated list of {', '.join(known)}, got {','.join(values)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency: integers >= 1, got {self.concurrency}")
        for name, low in (("repeats", 1), ("max_tokens", 2), ("num_speculative_tokens", 1)):  # TPOT needs 2 tokens
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= {low}, got {getattr(self, name)}")
        if "eagle3" in self.methods and self.eagle_head is None:
            raise ValueError(f"--methods eagle3: the committed head is for {DEFAULT_MODEL} only; "
                             f"give --eagle-model for {self.model}")

    @property
    def eagle_head(self) -> str | None:
        """The EAGLE-3 head eagle3 drafts with (None: no head for this model)."""
        return eagle_head_for(self.model, self.eagle_model)

    def num_requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_slot * concurrency)

    def speculative(self, method: str) -> SpeculativeConfig | None:
        if method == "off":
            return None
        keys: dict[str, object] = {"method": method, "num_speculative_tokens": self.num_speculative_tokens,
                                   "disable_by_batch_size": self.disable_by_batch_size,
                                   "measure_payoff": self.measure_payoff}
        if method == "ngram":
            keys |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        else:
            keys["model"] = self.eagle_head if method == "eagle3" else self.draft_model
        return SpeculativeConfig.parse({k: v for k, v in keys.items() if v is not None})


def eagle_head_for(model: str, eagle_model: str | None) -> str | None:
    """`eagle_model`, else the committed head when `model` is the embedded one, else None."""
    if eagle_model is not None:
        return eagle_model
    return DEFAULT_EAGLE_MODEL if Path(model).resolve() == Path(DEFAULT_MODEL).resolve() else None


QUICK = SpecBenchConfig(
    methods=("off", "ngram", "draft_model"), concurrency=(1, 4), requests_per_slot=1, min_requests=4, max_tokens=24,
    repeats=2, threads=1,
)


# -- one closed loop -------------------------------------------------------------------


def closed_loop(engine: LLMEngine, requests: Sequence[SpecRequest], concurrency: int, tag: str) -> list[RequestOutput]:
    """Run `requests` with `concurrency` of them in flight; their outputs in workload order."""
    outputs: dict[int, RequestOutput] = {}
    queue = iter(range(len(requests)))

    def submit() -> None:
        i = next(queue, None)
        if i is not None:
            params = SamplingParams(max_tokens=requests[i].max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{tag}-{i}", list(requests[i].prompt), params)

    for _ in range(concurrency):
        submit()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[int(out.request_id.rsplit("-", 1)[1])] = out
            submit()
    return [outputs[i] for i in range(len(requests))]


def tpot(out: RequestOutput) -> float:
    """Mean time per output token after the first (nan for a single token)."""
    n = len(out.outputs[0].token_ids)
    times = out.times
    if n < 2 or times is None or times.first_token is None:
        return math.nan
    return (times.finished - times.first_token) / (n - 1)


def spec_delta(after: SpecStats, before: SpecStats) -> SpecStats:
    before_pos = before.num_accepted_tokens_per_pos or (0,) * len(after.num_accepted_tokens_per_pos)
    return SpecStats(
        after.num_drafts - before.num_drafts,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        tuple(a - b for a, b in zip(after.num_accepted_tokens_per_pos, before_pos)),
        after.num_unspeculated_requests - before.num_unspeculated_requests,
    )


def measure(engine: LLMEngine, method: str, workload: str, requests: Sequence[SpecRequest], concurrency: int,
            rep: int) -> Run:
    before = engine.stats().spec_decode
    start, cpu = time.perf_counter(), time.process_time()
    outs = closed_loop(engine, requests, concurrency, f"{workload}-c{concurrency}-r{rep}")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    engine.check_integrity()
    tokens = tuple(tuple(o.outputs[0].token_ids) for o in outs)
    return Run(method, workload, concurrency, rep, wall, cpu, sum(map(len, tokens)),
               median(tpot(o) for o in outs), spec_delta(engine.stats().spec_decode, before), tokens)


# -- engines and workloads --------------------------------------------------------------


def build_engine(cfg: SpecBenchConfig, method: str, longest_prompt: int) -> LLMEngine:
    """An engine whose pool holds the largest closed loop at full length (no preemption)."""
    per_request = -(-(longest_prompt + cfg.max_tokens + cfg.num_speculative_tokens + 1) // cfg.block_size)
    most = max(cfg.concurrency)
    return LLMEngine(EngineConfig(
        model=cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
        cache=CacheConfig(cfg.block_size, most * per_request + 8, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=most),
        speculative=cfg.speculative(method),
    ))


def workloads(cfg: SpecBenchConfig) -> dict[str, list[SpecRequest]]:
    """Each workload's requests, as many as the largest closed loop runs (smaller ones
    take the first); functions are reused in turn when the held-out files run short."""
    tokenizer = Tokenizer(cfg.tokenizer or cfg.model)
    count = max(cfg.num_requests(c) for c in cfg.concurrency)
    fns = draw_functions(tokenizer.encode, count, cfg.function_tokens, cfg.seed)
    if not fns:
        raise ValueError(f"no held-out function of {cfg.function_tokens} tokens")
    fns = [fns[i % len(fns)] for i in range(count)]
    return {w: make_requests(w, fns, tokenizer.encode, cfg.max_tokens) for w in cfg.workloads}


def warm_up(engine: LLMEngine, cfg: SpecBenchConfig, requests: Sequence[SpecRequest]) -> None:
    """A full-length batch at the largest concurrency: the process's first one at that size
    ran up to 1.9x slower than later ones (memory growing), and 16-token warm-up requests
    did not take that cost away from the first measured run."""
    most = max(cfg.concurrency)
    closed_loop(engine, requests[-most:], most, "warmup")


# -- main ------------------------------------------------------------------------------------


def report_json(cfg: SpecBenchConfig, cells: Sequence[Cell], runs: Sequence[Run], problems: Sequence[str],
                line: str) -> dict:
    return {
        "config": asdict(cfg), "environment": environment(cfg), "cells": [asdict(c) for c in cells],
        "runs": [{k: v for k, v in asdict(r).items() if k != "tokens"}
                 | {"throughput": r.throughput, "cpu_throughput": r.cpu_throughput} for r in runs],
        "problems": list(problems), "last_line": line,
    }


def environment(cfg: SpecBenchConfig) -> dict[str, object]:
    return {"torch": torch.__version__, "device": cfg.device, "dtype": cfg.dtype, "threads": torch.get_num_threads(),
            "machine": machine_load(), "draft_model": cfg.draft_model}


def run_all(cfg: SpecBenchConfig, log: Callable[[str], None]) -> list[Run]:
    reqs = workloads(cfg)
    for workload, requests in reqs.items():
        lengths = [len(r.prompt) for r in requests]
        log(f"[workload] {workload}: {len(requests)} prompts of {min(lengths)}-{max(lengths)} tokens "
            f"(median {median(lengths):.0f}), max_tokens {cfg.max_tokens}")
    longest = max(len(r.prompt) for rs in reqs.values() for r in rs)
    engines = {}
    for method in cfg.methods:
        start = time.perf_counter()
        engines[method] = build_engine(cfg, method, longest)
        warm_up(engines[method], cfg, reqs[cfg.workloads[0]])
        log(f"[engine] {method}: built and warmed up in {time.perf_counter() - start:.1f} s")
    runs = []
    for rep in range(cfg.repeats):
        for workload in cfg.workloads:
            for concurrency in cfg.concurrency:
                requests = reqs[workload][: cfg.num_requests(concurrency)]
                for method in rotated(cfg.methods, rep):
                    run = measure(engines[method], method, workload, requests, concurrency, rep)
                    log(f"[repeat {rep + 1}/{cfg.repeats}] {workload} c={concurrency} {method}: "
                        f"{run.throughput:.1f} tok/s, TPOT {1e3 * run.tpot_s:.2f} ms")
                    runs.append(run)
    return runs


def run(cfg: SpecBenchConfig, json_path: str | None, plot_path: str | None) -> tuple[str, list[str]]:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    hf_logging.set_verbosity_error()  # the tokenizer warns of functions longer than the model's context
    print(" ".join(f"{k}={v}" for k, v in environment(cfg).items()), flush=True)
    runs = run_all(cfg, lambda msg: print(msg, flush=True))
    cells, problems = analyse(runs)
    print("\n".join(["", *table(cells), ""]), flush=True)
    print("\n".join([*acceptance_summary(runs), *head_lines(cells, runs)]), flush=True)
    line = last_line(cells, runs)
    if json_path:
        Path(json_path).write_text(json.dumps(report_json(cfg, cells, runs, problems, line), indent=1) + "\n")
    if plot_path:
        from pdserve.bench.common.plot import plot_acceptance

        plot_acceptance(acceptance_curves(cells, runs), plot_path,
                        f"acceptance by draft position (K={cfg.num_speculative_tokens}, {cfg.model.rsplit('/', 1)[-1]})")
    return line, problems


@dataclass(frozen=True)
class SpecFlags:
    """The command line; a flag left out keeps the preset's value."""

    quick: bool = flag(False, "concurrency 1 and 4, 4 short requests, 2 repetitions")
    repeats: int | None = flag(None, "interleaved repetitions (3)")
    concurrency: tuple[int, ...] | None = flag(None, "comma-separated (1,4,16,64)")
    methods: tuple[str, ...] | None = flag(None, "comma-separated subset of off,ngram,draft_model,eagle3 (all; eagle3 "
                                                 "only with the embedded model or --eagle-model)")
    workloads: tuple[str, ...] | None = flag(None, "comma-separated subset of grounded,completion")
    max_tokens: int | None = flag(None, "tokens generated per request (96)")
    num_speculative_tokens: int | None = flag(None, "K, draft tokens per step (4)")
    prompt_lookup_min: int | None = flag(None, "ngram: shortest n-gram matched (the engine's default)")
    prompt_lookup_max: int | None = flag(None, "ngram: longest n-gram matched (the engine's default)")
    disable_by_batch_size: int | None = flag(None, "no drafting at this many running requests or more")
    measure_payoff: bool | None = flag(None, "draft only where it pays on this machine (the engine's default: true)")
    model: str | None = flag(None, f"target model directory ({DEFAULT_MODEL})")
    draft_model: str | None = flag(None, f"draft model directory ({DEFAULT_DRAFT_MODEL})")
    eagle_model: str | None = flag(None, f"EAGLE-3 head directory ({DEFAULT_EAGLE_MODEL})")
    tokenizer: str | None = flag(None, "directory of the tokenizer that encodes the prompts (the model's)")
    device: str | None = flag(None, "torch device (cpu)")
    dtype: str | None = flag(None, "model dtype (float32)")
    threads: int | None = flag(None, "torch threads (torch's default)")
    seed: int | None = flag(None, "seed of the prompts")
    report: ReportFlags = flag(ReportFlags(), "where the report is written")


def config_from(flags: SpecFlags) -> SpecBenchConfig:
    """The preset (QUICK or the full run) with every flag given on top; eagle3 left out
    of the default methods where the model has no EAGLE-3 head."""
    cfg = overridden(QUICK if flags.quick else SpecBenchConfig(), flags)
    if flags.methods is None and not flags.quick and eagle_head_for(cfg.model, cfg.eagle_model) is None:
        cfg = replace(cfg, methods=tuple(m for m in METHODS if m != "eagle3"))  # no EAGLE-3 head for that model
    for method in cfg.methods:
        cfg.speculative(method)  # a bad combination is the command line's error
    return cfg


def main(argv: Sequence[str] | None, prog: str, doc: str | None) -> int:
    """bench.spec.methods's main (and bench.spec.gpu's, with its models' flags in front)."""
    cfg, flags = parse(SpecFlags, argv, prog, doc, lambda f: (config_from(f), f))
    return compare_main("bench.spec.methods", lambda: run(cfg, flags.report.json, flags.report.plot))

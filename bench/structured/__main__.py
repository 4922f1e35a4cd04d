"""Structured outputs benchmark (issue 37): what a JSON-schema constraint costs a decode
step, at concurrency 1 and 16, against the same requests unconstrained.

    python -m pdserve.bench.structured                 # the embedded model, 48 requests, 3 repetitions
    python -m pdserve.bench.structured --quick         # 8 requests, concurrency 1 and 4, 1 repetition
    python -m pdserve.bench.structured --backend llguidance

What runs (bench/structured/run.py), on one engine in this process:
  1. compile time per schema: a one-token request with a schema the engine has not
     seen, then the same again (a compile-cache hit): the difference is the compile;
  2. the constrained requests once, to learn how many tokens each generates (its
     grammar ends it), every output checked: JSON that validates against its schema;
  3. per concurrency, k interleaved repetitions of constrained, then the unconstrained
     twins (each generating exactly its twin's tokens): TPOT p50 and output
     throughput, ratios as median (min, max, k);
  4. hostile (--no-hostile skips it): a greedy victim decodes alone, then again while
     an invalid, a too deep, a too large, an endlessly recursive schema, a bad regex
     and a regex that compiles for seconds (past a 1 s deadline) are sent beside it:
     each must fail alone (refused at admission, INVALID_CONSTRAINT, CONSTRAINT_TIMEOUT),
     the victim's tokens unchanged; printed `victim_tpot_ratio=R` (beside / alone,
     target <= 1.5).

The last line:

    structured_valid=N/N structured_tpot_ratio_c16=X

N/N: constrained outputs that validated, of all generated; X: TPOT p50 constrained /
unconstrained at concurrency 16 (the largest asked for, with --concurrency). The exit
status is 1 when an output did not validate or a hostile request did not fail alone,
never because of a speed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.common.entry import compare_main, parse
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, fmt, median
from pdserve.bench.structured.run import (
    SCHEMAS,
    constrained_jobs,
    hostile_problems,
    run_closed_loop,
    run_hostile,
    unconstrained_twins,
    validate_outputs,
)
from pdserve.services.common.flags import flag


@dataclass(frozen=True)
class StructuredFlags:
    quick: bool = flag(False, "8 requests at concurrency 1 and 4, one repetition (explicit flags still win)")
    requests: int | None = flag(None, "requests per run (48)")
    concurrency: tuple[int, ...] | None = flag(None, "requests in flight, each a comparison, e.g. 1,16")
    repeats: int | None = flag(None, "interleaved repetitions (3)")
    backend: str = flag("xgrammar", "the grammar backend (xgrammar, llguidance)")
    model: str | None = flag(None, "model directory with its tokenizer (default: the embedded model)")
    temperature: float = flag(0.0, "sampling temperature (seeded per request when > 0)")
    torch_threads: int = flag(1, "torch threads of the engine")
    seed: int = flag(0, "seed of the requests' samples")
    hostile: bool = flag(True, "the hostile phase: a victim decoding beside invalid, huge, deep, endless and slow "
                               "constraints (a 1 s compile deadline)")


@dataclass(frozen=True)
class Config:
    requests: int
    concurrency: tuple[int, ...]
    repeats: int
    backend: str
    model: str | None
    temperature: float
    torch_threads: int
    seed: int
    hostile: bool = True


def config_from(f: StructuredFlags) -> Config:
    requests, concurrency, repeats = (8, (1, 4), 1) if f.quick else (48, (1, 16), 3)
    cfg = Config(requests if f.requests is None else f.requests,
                 tuple(concurrency if f.concurrency is None else f.concurrency),
                 repeats if f.repeats is None else f.repeats, f.backend, f.model, f.temperature, f.torch_threads, f.seed,
                 f.hostile)
    if cfg.requests < 1 or not cfg.concurrency or min(cfg.concurrency) < 1 or cfg.repeats < 1:
        raise ValueError("requests, concurrency and repeats: must be >= 1")
    return cfg


def run(cfg: Config) -> tuple[str, list[str]]:
    import torch

    from pdserve.bench.common.machine import machine_load
    from pdserve.engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.tokenizer import Tokenizer

    torch.set_num_threads(cfg.torch_threads)
    print(f"isa={torch.backends.cpu.get_cpu_capability()} {machine_load()}", flush=True)
    model = cfg.model or DEFAULT_MODEL
    engine = LLMEngine(EngineConfig(model=model, cache=CacheConfig(block_size=16, num_blocks=1024),
                                    structured_outputs_backend=cfg.backend))
    tokenizer = Tokenizer(model)
    print(f"model: {model}, fp32, cpu, torch_threads={cfg.torch_threads}, backend={cfg.backend}, "
          f"{len(SCHEMAS)} schemas, temperature {cfg.temperature:g}", flush=True)

    compile_seconds = _compile_times(engine, tokenizer)
    print(f"compile per schema (cold - cache hit): median {median(compile_seconds) * 1e3:.1f} ms, "
          f"max {max(compile_seconds) * 1e3:.1f} ms over {len(compile_seconds)} schemas", flush=True)

    jobs = constrained_jobs(tokenizer.encode, cfg.requests, cfg.temperature, cfg.seed)
    reference = run_closed_loop(engine, jobs, max(cfg.concurrency), "reference", "ref", tokenizer.decode)
    problems = validate_outputs(jobs, reference)
    generated, valid = len(jobs), len(jobs) - len(problems)
    twins = unconstrained_twins(jobs, reference.lengths)
    print(f"outputs: {reference.output_tokens} tokens, {min(reference.lengths)}-{max(reference.lengths)} a request; "
          f"e.g. {reference.texts[0]!r}", flush=True)

    ratios: dict[int, tuple[Ratio, Ratio]] = {}
    for c in cfg.concurrency:
        runs = interleaved({
            "constrained": lambda rep, c=c: run_closed_loop(engine, jobs, c, "constrained", f"s{c}-{rep}",
                                                            tokenizer.decode),
            "unconstrained": lambda rep, c=c: run_closed_loop(engine, twins, c, "unconstrained", f"u{c}-{rep}",
                                                              tokenizer.decode),
        }, cfg.repeats)
        for rep in range(cfg.repeats):
            for name in ("constrained", "unconstrained"):
                print(f"[{rep + 1}/{cfg.repeats}] {runs[name][rep].line()}", flush=True)
        for result in runs["constrained"]:
            found = validate_outputs(jobs, result)
            generated, valid = generated + len(jobs), valid + len(jobs) - len(found)
            problems += found
        tpot = Ratio.paired([r.tpot_p50 for r in runs["constrained"]], [r.tpot_p50 for r in runs["unconstrained"]])
        tput = Ratio.paired([r.throughput for r in runs["constrained"]], [r.throughput for r in runs["unconstrained"]])
        ratios[c] = (tpot, tput)
        print(f"concurrency {c}: tpot_p50 constrained/unconstrained {tpot}; "
              f"throughput constrained/unconstrained {tput}", flush=True)
    if cfg.hostile:
        problems += _hostile(cfg, model, tokenizer)
    top = max(cfg.concurrency)
    last = f"structured_valid={valid}/{generated} structured_tpot_ratio_c{top}={fmt(ratios[top][0].median)}"
    if top != 16:  # the figure is at 16: say which one this is
        print(f"note: the largest concurrency run was {top}, not 16")
    return last, problems


def _hostile(cfg: Config, model: str, tokenizer) -> list[str]:
    """The hostile phase on an engine of its own (a 1 s compile deadline, default limits)."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import LLMEngine

    config = EngineConfig(model=model, cache=CacheConfig(block_size=16, num_blocks=256),
                          structured_outputs_backend=cfg.backend, structured_outputs_compile_timeout=1.0)
    engine = LLMEngine(config)
    try:
        result = run_hostile(engine, tokenizer.encode("def main():\n    "), config.structured_outputs_max_bytes,
                             config.structured_outputs_max_depth)
    finally:
        engine.close()
    for name, outcome in result.outcomes.items():
        print(f"hostile {name:<18} {outcome}")
    print(f"victim: tpot_p50 alone {result.victim_alone.tpot_p50 * 1e3:.2f} ms, beside the hostile requests "
          f"{result.victim_beside.tpot_p50 * 1e3:.2f} ms: victim_tpot_ratio={result.tpot_ratio:.3f} (target <= 1.5)",
          flush=True)
    return hostile_problems(result)


def _compile_times(engine, tokenizer) -> list[float]:
    """Seconds each schema's compile adds: a one-token request with it cold, minus the
    same request again (the compile cache's hit)."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.structured.params import StructuredOutputs

    prompt = tokenizer.encode("x = ")
    out = []
    for i, schema in enumerate(SCHEMAS):
        params = SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=StructuredOutputs.json_schema(schema))
        times = []
        for attempt in ("cold", "warm"):
            start = time.perf_counter()
            engine.add_request(f"compile-{i}-{attempt}", prompt, params)
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - start)
        out.append(max(0.0, times[0] - times[1]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse(StructuredFlags, argv, "python -m pdserve.bench.structured", __doc__, config_from)
    return compare_main("bench.structured", lambda: run(cfg))


if __name__ == "__main__":
    sys.exit(main())

"""Parallel sampling (n=8): what sharing the prompt's blocks saves.

Run as `python -m pdserve.bench.engine.offline --workload parallel [--quick]`. In one process, on one
random-initialised Llama, the same work is done twice:

* shared: each prompt is one request with `n=8` -- prefilled once, the eight samples
  fork from its KV (full blocks shared by reference count, the partial last block
  copied on write);
* unshared: eight independent requests per prompt with the prefix cache off, so every
  sample stores (and computes) the prompt's KV itself -- what a server without block
  sharing does.

It reports the peak number of KV blocks in use and the throughput of each; the last
line is `block_saving=X` (peak blocks without sharing / with sharing).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common.random_model import ModelSpec, save_random_model, temporary_dir
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine


@dataclass(frozen=True)
class ParallelSpec:
    model: ModelSpec = ModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                                 intermediate_size=1408, vocab_size=32000)
    num_prompts: int = 6
    prompt_len: int = 500
    n: int = 8
    new_tokens: int = 32
    block_size: int = 16
    seed: int = 0


QUICK = ParallelSpec(
    model=ModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512),
    num_prompts=2, prompt_len=200, new_tokens=8,
)


@dataclass(frozen=True)
class RunStats:
    seconds: float
    peak_blocks: int
    output_tokens: int


def _prompts(spec: ParallelSpec) -> list[list[int]]:
    rng = random.Random(spec.seed)
    return [[rng.randrange(3, spec.model.vocab_size) for _ in range(spec.prompt_len)] for _ in range(spec.num_prompts)]


def _engine(model_dir: Path, spec: ParallelSpec, num_blocks: int, prefix_caching: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(spec.block_size, num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
    ))


def _drain(engine: LLMEngine) -> RunStats:
    start, peak, tokens = time.perf_counter(), 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += sum(len(c.token_ids) for c in out.outputs)
        stats = engine.stats()
        peak = max(peak, stats.num_blocks - stats.num_free_blocks)
    engine.check_integrity()
    return RunStats(time.perf_counter() - start, peak, tokens)


def run_shared(model_dir: Path, spec: ParallelSpec, num_blocks: int) -> RunStats:
    engine = _engine(model_dir, spec, num_blocks, prefix_caching=True)
    for i, prompt in enumerate(_prompts(spec)):
        params = SamplingParams(max_tokens=spec.new_tokens, temperature=1.0, n=spec.n, seed=i, ignore_eos=True)
        engine.add_request(f"p{i}", prompt, params)
    return _drain(engine)


def run_unshared(model_dir: Path, spec: ParallelSpec, num_blocks: int) -> RunStats:
    engine = _engine(model_dir, spec, num_blocks, prefix_caching=False)
    for i, prompt in enumerate(_prompts(spec)):
        for j in range(spec.n):
            params = SamplingParams(max_tokens=spec.new_tokens, temperature=1.0, seed=i * spec.n + j, ignore_eos=True)
            engine.add_request(f"p{i}-{j}", prompt, params)
    return _drain(engine)


def run(spec: ParallelSpec) -> str:
    # Room for everything at once without sharing, so neither run preempts.
    per_seq = -(-(spec.prompt_len + spec.new_tokens) // spec.block_size)
    num_blocks = spec.num_prompts * spec.n * per_seq + 16
    with temporary_dir("pdserve-parallel-") as model_dir:
        save_random_model(spec.model, model_dir, spec.seed)
        print(f"model: hidden={spec.model.hidden_size} layers={spec.model.num_layers} "
              f"vocab={spec.model.vocab_size}; {spec.num_prompts} prompts x {spec.prompt_len} tokens, "
              f"n={spec.n}, {spec.new_tokens} new tokens each, block_size={spec.block_size}", flush=True)
        run_shared(model_dir, spec, num_blocks)  # warm-up
        shared = run_shared(model_dir, spec, num_blocks)
        unshared = run_unshared(model_dir, spec, num_blocks)
    for name, r in (("shared blocks (n=8)", shared), ("no sharing (8 requests)", unshared)):
        print(f"{name:26s} peak blocks {r.peak_blocks:6d}   wall {r.seconds:7.2f} s   "
              f"{r.output_tokens / r.seconds:8.1f} output tok/s", flush=True)
    print(f"throughput ratio shared / unshared: {unshared.seconds / shared.seconds:.2f}", flush=True)
    return f"block_saving={unshared.peak_blocks / shared.peak_blocks:.2f}"

"""Sampled decoding: what an engine step costs when its requests sample.

Run as `python -m pdserve.bench.engine.offline --workload sampled [--quick]`. In one process,
on one random-initialised Llama with a realistic vocabulary (32000), a batch of
requests decodes together with the sampling parameters a server sees mixed in one
batch:

    request i % 4 == 0   temperature 0.8, top_p 0.9        (nucleus)
                    1    temperature 0.7, top_k 50
                    2    greedy
                    3    temperature 1.0 (plain sampling: top_p 1, top_k off)

Every request is seeded and ignores EOS, so every run does the same work. Two figures
come out, each the median over the repeats after a warm-up run:

* the decode step: wall time of `LLMEngine.step()` once every prompt is prefilled
  (model forward + sampling + bookkeeping for the whole batch);
* the sampler alone: `Sampler(logits, requests)` on logits of the same shape and the
  same requests, i.e. the part of the step the sampling parameters decide.

The last line is `sampled_step_ms=X sampler_ms=Y` (medians, milliseconds).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench.common.random_model import ModelSpec, save_random_model, temporary_dir
from pdserve.bench.common.stats import median, percentile
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledSpec:
    model: ModelSpec = ModelSpec(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                 intermediate_size=640, vocab_size=32000)
    num_seqs: int = 32
    prompt_len: int = 32
    new_tokens: int = 48
    repeats: int = 3
    sampler_calls: int = 50
    block_size: int = 16
    seed: int = 0


QUICK = SampledSpec(
    model=ModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    vocab_size=32000, max_position_embeddings=256),
    num_seqs=8, prompt_len=16, new_tokens=8, repeats=1, sampler_calls=5,
)


def sampling_mix(i: int, max_tokens: int) -> SamplingParams:
    """The i-th request's parameters (see the module docstring)."""
    kinds = (
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=0.7, top_k=50),
        dict(temperature=0.0),
        dict(temperature=1.0),
    )
    return SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True, **kinds[i % len(kinds)])


def _prompts(spec: SampledSpec) -> list[list[int]]:
    rng = random.Random(spec.seed)
    return [[rng.randrange(3, spec.model.vocab_size) for _ in range(spec.prompt_len)] for _ in range(spec.num_seqs)]


def _engine(model_dir: Path, spec: SampledSpec) -> LLMEngine:
    per_seq = -(-(spec.prompt_len + spec.new_tokens) // spec.block_size)
    return LLMEngine(EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(spec.block_size, spec.num_seqs * per_seq + 8, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=spec.num_seqs, max_num_batched_tokens=spec.num_seqs * spec.prompt_len),
    ))


def decode_step_times(engine: LLMEngine, spec: SampledSpec, tag: str) -> list[float]:
    """Run the workload once; the wall time of every step after the prefill step."""
    for i, prompt in enumerate(_prompts(spec)):
        engine.add_request(f"{tag}-{i}", prompt, sampling_mix(i, spec.new_tokens))
    engine.step()  # the prefill of every prompt (the token budget holds them all)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.check_integrity()
    return times


def sampler_times(spec: SampledSpec) -> list[float]:
    """The sampler alone, on fixed random logits of the decode batch's shape."""
    gen = torch.Generator().manual_seed(spec.seed)
    logits = torch.randn((spec.num_seqs, spec.model.vocab_size), generator=gen) * 4
    requests = []
    for i, prompt in enumerate(_prompts(spec)):
        request = Request(f"s{i}", prompt, sampling_mix(i, spec.new_tokens), spec.block_size, eos_token_ids=(2,))
        request.append_token(5)
        requests.append(request)
    sampler = Sampler(spec.seed)
    sampler(logits, requests)  # warm-up
    times = []
    for _ in range(spec.sampler_calls):
        start = time.perf_counter()
        sampler(logits, requests)
        times.append(time.perf_counter() - start)
    return times


def run(spec: SampledSpec) -> str:
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    m = spec.model
    print(f"model: hidden={m.hidden_size} layers={m.num_layers} vocab={m.vocab_size}; {spec.num_seqs} sequences, "
          f"prompts of {spec.prompt_len}, {spec.new_tokens} new tokens, mix: top_p / top_k / greedy / plain; "
          f"torch threads={torch.get_num_threads()} load_avg_1m={load:.2f} cpus={cpus}", flush=True)
    steps: list[float] = []
    with temporary_dir("pdserve-sampled-") as model_dir:
        save_random_model(spec.model, model_dir, spec.seed)
        engine = _engine(model_dir, spec)
        decode_step_times(engine, spec, "warmup")
        for r in range(spec.repeats):
            steps += decode_step_times(engine, spec, f"run{r}")
    sampled = sampler_times(spec)
    step_ms, sampler_ms = 1e3 * median(steps), 1e3 * median(sampled)
    print(f"decode step ({spec.num_seqs} seqs): median {step_ms:.2f} ms over {len(steps)} steps "
          f"(p10 {1e3 * percentile(steps, 10):.2f}, p90 {1e3 * percentile(steps, 90):.2f})", flush=True)
    print(f"sampler alone: median {sampler_ms:.2f} ms over {len(sampled)} calls "
          f"({100 * sampler_ms / step_ms:.0f} % of a step)", flush=True)
    return f"sampled_step_ms={step_ms:.3f} sampler_ms={sampler_ms:.3f}"

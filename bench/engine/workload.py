"""The offline benchmarks' workload (bench.engine.offline, bench.quant.schemes): seeded
requests of random token ids and a per-request number of new tokens, never the special
ids 0-2, so every system does the same work with EOS ignored.

    WorkloadSpec --make_workload(spec, vocab, rep)--> [Request(prompt, max_new_tokens)]
    repetition 0 is the seed's; later ones draw their own (nothing cached is reused)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.common.random_model import FIRST_REGULAR_TOKEN, ModelSpec


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 24
    prompt_len: tuple[int, int] = (32, 384)  # inclusive range, uniform
    new_tokens: tuple[int, int] = (32, 96)  # inclusive range, uniform
    seed: int = 0


QUICK_MODEL = ModelSpec(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
    vocab_size=512, max_position_embeddings=256,
)


QUICK_WORKLOAD = WorkloadSpec(num_requests=8, prompt_len=(8, 48), new_tokens=(4, 16))


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int


def make_requests(
    num: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int], vocab_size: int, rng: random.Random
) -> list[Request]:
    requests = []
    for _ in range(num):
        length = rng.randint(*prompt_len)
        prompt = tuple(rng.randrange(FIRST_REGULAR_TOKEN, vocab_size) for _ in range(length))
        requests.append(Request(prompt, rng.randint(*new_tokens)))
    return requests


def make_workload(spec: WorkloadSpec, vocab_size: int, rep: int = 0) -> list[Request]:
    """Repetition 0 is the seed's workload (as before repetitions existed); later ones
    draw their own, so nothing an earlier repetition cached can be reused."""
    rng = random.Random(spec.seed if rep == 0 else f"{spec.seed}-rep-{rep}")
    return make_requests(spec.num_requests, spec.prompt_len, spec.new_tokens, vocab_size, rng)


def make_warmup(vocab_size: int, seed: int) -> list[Request]:
    """Two tiny requests from their own RNG stream: nothing the workload could reuse from a prefix cache."""
    return make_requests(2, (8, 16), (4, 4), vocab_size, random.Random(f"warmup-{seed}"))


def prompt_tokens(requests: Sequence[Request]) -> int:
    return sum(len(r.prompt) for r in requests)


def output_tokens(requests: Sequence[Request]) -> int:
    return sum(r.max_new_tokens for r in requests)

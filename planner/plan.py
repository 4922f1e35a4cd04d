"""`pdserve plan --profile`: the cheapest split of workers that meets TTFT and TPOT
targets at a request rate, searched in the simulator (simulator.py) on a profile.

    pdserve plan --profile profile.json --rate 8 --input-len 512 --output-len 128 \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 [--max-workers 8 | --gpus 8] [--attainment 0.9]

    for n = 1 .. --max-workers workers:
        n mixed (colocated), and every p prefill + d decode (p + d = n) at each
        --local-prefill-thresholds value
        simulate --requests requests of the traffic (Poisson at --rate, or bursty with
        --burstiness > 1; lengths --input-len and --output-len, each +- --length-spread)
    the cheapest (fewest workers) whose share of requests meeting both targets is at
    least --attainment; among those, the highest goodput; every split of that size and
    the best of each smaller size printed side by side, with goodput per worker

Last line: `plan prefill=P decode=D mixed=M local_prefill_threshold=T workers=N` or,
when no split within the bound meets the targets, `plan none closest=<split> met=X`.
The profile must be of the model planned (`--model`, when given, is checked against the
profile's config digest); one taken on another machine is used with a warning (a GPU
profile plans a GPU cluster). The simulator's limits are the workers' flags
(--max-num-batched-tokens, --max-num-seqs, --block-size; --num-blocks, else the
profile's).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.planner.profile import Profile, machine
from pdserve.planner.simulator import Figures, Limits, Shape, SimRequest, Simulation, Traffic, figures
from pdserve.services.common.flags import check, flag

THRESHOLDS = (0, 64, 256, 1024)


@dataclass(frozen=True)
class SloPlanConfig:
    profile: str | None = flag(None, "plan by SLO: a profile from `pdserve profile` (JSON); the rest of the SLO "
                                     "flags apply only with it")
    rate: float | None = flag(None, "requests per second to serve (with --profile)")
    input_len: int | None = flag(None, "prompt tokens of a request (with --profile)")
    slo_ttft_ms: float | None = flag(None, "time to first token a request must meet, ms (with --profile)")
    slo_tpot_ms: float | None = flag(None, "time per output token a request must meet, ms (with --profile)")
    attainment: float = flag(0.9, "share of requests that must meet both targets")
    max_workers: int | None = flag(None, "largest split to consider (default 8)")
    gpus: int | None = flag(None, "as --max-workers: one worker per GPU")
    length_spread: float = flag(0.0, "lengths drawn uniformly within +- this share of --input-len/--output-len")
    burstiness: float = flag(1.0, "coefficient of variation of inter-arrival times (1: Poisson)")
    requests: int = flag(1000, "requests simulated per split")
    local_prefill_thresholds: tuple[int, ...] = flag(THRESHOLDS, "the router's --local-prefill-threshold values "
                                                                 "tried for splits with prefill workers")
    num_blocks: int | None = flag(None, "KV blocks per worker (default: the profile's)")
    seed: int = flag(0, "seed of the simulated traffic")

    def check(self, output_len: int | None) -> None:
        """ValueError naming the first flag that makes no sense (`output_len`: the shared flag)."""
        check(self.rate is not None and self.rate > 0 and math.isfinite(self.rate), "rate",
              "must be given with --profile, a positive number of requests per second", self.rate)
        check(self.input_len is not None and self.input_len >= 1, "input_len", "must be given, >= 1", self.input_len)
        check(output_len is not None and output_len >= 1, "output_len", "must be given with --profile, >= 1",
              output_len)
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            check(value is not None and value > 0 and math.isfinite(value), name, "must be given, > 0 ms", value)
        check(0 < self.attainment <= 1, "attainment", "must be in (0, 1]", self.attainment)
        check(self.max_workers is None or self.max_workers >= 1, "max_workers", "must be >= 1", self.max_workers)
        check(self.gpus is None or self.gpus >= 1, "gpus", "must be >= 1", self.gpus)
        check(0 <= self.length_spread < 1, "length_spread", "must be in [0, 1)", self.length_spread)
        check(self.burstiness > 0, "burstiness", "must be > 0", self.burstiness)
        check(self.requests >= 10, "requests", "must be >= 10", self.requests)
        check(all(t >= 0 for t in self.local_prefill_thresholds) and bool(self.local_prefill_thresholds),
              "local_prefill_thresholds", "must be one or more values >= 0", self.local_prefill_thresholds)
        check(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", "must be >= 1", self.num_blocks)

    @property
    def bound(self) -> int:
        return self.max_workers or self.gpus or 8


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    figures: Figures

    @property
    def workers(self) -> int:
        return self.shape.workers

    def record(self) -> dict:
        return {"prefill": self.shape.prefill, "decode": self.shape.decode, "mixed": self.shape.mixed,
                "local_prefill_threshold": self.shape.local_prefill_threshold, **asdict(self.figures),
                "goodput_per_worker": self.figures.goodput / self.workers}


def shapes(workers: int, thresholds: tuple[int, ...]) -> list[Shape]:
    """Every split of exactly `workers` workers the search considers."""
    out = [Shape(mixed=workers)]
    for p in range(1, workers):
        out += [Shape(prefill=p, decode=workers - p, mixed=0, local_prefill_threshold=t) for t in thresholds]
    return out


def traffic(config: SloPlanConfig, output_len: int) -> list[SimRequest]:
    def span(n: int) -> tuple[int, int]:
        d = int(n * config.length_spread)
        return max(1, n - d), n + d

    assert config.rate is not None and config.input_len is not None
    return Traffic(config.rate, config.requests, span(config.input_len), span(output_len), config.burstiness,
                   config.seed).draw()


def evaluate(profile: Profile, shape: Shape, limits: Limits, requests: list[SimRequest],
             config: SloPlanConfig) -> Candidate:
    outcomes = Simulation(profile, shape, limits).run(requests)
    assert config.slo_ttft_ms is not None and config.slo_tpot_ms is not None
    return Candidate(shape, figures(outcomes, config.slo_ttft_ms / 1000, config.slo_tpot_ms / 1000))


def search(profile: Profile, config: SloPlanConfig, limits: Limits, output_len: int) -> tuple[Candidate | None,
                                                                                                list[Candidate]]:
    """The chosen split (None: none meets the targets) and every split evaluated."""
    requests = traffic(config, output_len)
    tried: list[Candidate] = []
    for n in range(1, config.bound + 1):
        here = [evaluate(profile, s, limits, requests, config) for s in shapes(n, config.local_prefill_thresholds)]
        tried += here
        meeting = [c for c in here if c.figures.met >= config.attainment]
        if meeting:
            return max(meeting, key=lambda c: (c.figures.goodput, c.figures.met)), tried
    return None, tried


def check_profile(profile: Profile, model: str | None, warn) -> None:
    """Refuse a profile of another model than `model` (when given); warn when it was
    taken on another machine."""
    source = profile.source
    if model is not None:
        digest = hashlib.sha256((Path(model) / "config.json").read_bytes()).hexdigest()
        if source.get("config_sha256") not in (None, digest):
            raise ValueError(f"profile: taken on model {source.get('model')!r} (config.json sha256 "
                             f"{str(source.get('config_sha256'))[:12]}...), not on --model {model}")
    here = machine()
    there = source.get("machine", {})
    differs = [k for k in ("cpu", "isa", "gpu") if there.get(k) != here.get(k)]
    if differs:
        warn(f"warning: the profile was taken on another machine ({', '.join(f'{k} {there.get(k)!r}' for k in differs)}"
             f"; here {', '.join(repr(here.get(k)) for k in differs)}): the plan is for that machine")


def table(chosen: Candidate | None, tried: list[Candidate]) -> str:
    best_of: dict[int, Candidate] = {}
    for c in tried:
        if c.workers not in best_of or (c.figures.met, c.figures.goodput) > (best_of[c.workers].figures.met,
                                                                              best_of[c.workers].figures.goodput):
            best_of[c.workers] = c
    top = max(best_of) if best_of else 0
    rows = [c for c in tried if c.workers == top] + [best_of[n] for n in sorted(best_of) if n < top]
    lines = [f"{'split':<12}{'threshold':>10}{'ttft p50':>10}{'ttft p90':>10}{'tpot p50':>10}{'tpot p90':>10}"
             f"{'met':>7}{'goodput/s':>11}{'per worker':>11}"]
    for c in rows:
        f = c.figures
        threshold = str(c.shape.local_prefill_threshold) if c.shape.prefill else "-"
        mark = "  <- plan" if c is chosen else ""
        lines.append(f"{c.shape.label():<12}{threshold:>10}{f.ttft_p50 * 1000:>8.0f}ms{f.ttft_p90 * 1000:>8.0f}ms"
                     f"{f.tpot_p50 * 1000:>8.1f}ms{f.tpot_p90 * 1000:>8.1f}ms{f.met:>7.0%}{f.goodput:>11.2f}"
                     f"{f.goodput / c.workers:>11.2f}{mark}")
    return "\n".join(lines)


def run(config: SloPlanConfig, output_len: int | None, model: str | None, max_num_batched_tokens: int,
        max_num_seqs: int, block_size: int, as_json: bool = False) -> int:
    config.check(output_len)
    assert output_len is not None and config.profile is not None
    profile = Profile.read(config.profile)
    check_profile(profile, model, print)
    limits = Limits(max_num_batched_tokens, max_num_seqs,
                    config.num_blocks or profile.source.get("num_blocks") or 4096, block_size)
    chosen, tried = search(profile, config, limits, output_len)
    if as_json:
        print(json.dumps({"chosen": chosen.record() if chosen else None, "tried": [c.record() for c in tried]}))
    else:
        print(f"traffic: {config.rate:g} req/s, {config.input_len} prompt + {output_len} output tokens"
              f"{f' (+-{config.length_spread:.0%})' if config.length_spread else ''}, burstiness "
              f"{config.burstiness:g}; targets: TTFT {config.slo_ttft_ms:g} ms, TPOT {config.slo_tpot_ms:g} ms for "
              f"{config.attainment:.0%} of requests; profile {profile.source.get('model')} on "
              f"{profile.source.get('machine', {}).get('cpu')} ({config.requests} simulated requests per split)")
        print(table(chosen, tried))
    if chosen is None:
        closest = max(tried, key=lambda c: (c.figures.met, c.figures.goodput))
        print(f"plan none closest={closest.shape.label()} met={closest.figures.met:.3f}  (no split of at most "
              f"{config.bound} workers meets the targets at {config.rate:g} req/s)")
        return 1
    s = chosen.shape
    threshold = s.local_prefill_threshold if s.prefill else 0
    print(f"plan prefill={s.prefill} decode={s.decode} mixed={s.mixed} local_prefill_threshold={threshold} "
          f"workers={s.workers}")
    return 0

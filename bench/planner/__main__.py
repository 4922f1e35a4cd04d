"""The planner's evidence (issue 39), part (a): the simulator against the real cluster
on this machine.

    python -m pdserve.bench.planner [--quick] [--requests N] [--rate R]

1. `pdserve profile --serving` of the workers as the runs below start them (the
   embedded model, one torch thread, pinned to one core, the runs' --num-blocks), with
   the serving path's own cost measured on a one-worker cluster (profile.py).
2. For each workload (chat: short prompts; long: prompts that cross to a prefill
   worker) and each split (1 mixed worker; 1 prefill + 1 decode), a real `pdserve
   bench` run (its own `pdserve up` cluster, open-loop Poisson arrivals, greedy with
   ignore_eos), its per-request report read back.
3. The simulator replays exactly those requests (arrival times, prompt and output
   lengths) on the profile and the same split, and its TTFT and TPOT p50 / p90 are
   set beside the measured ones: relative error |sim - measured| / measured.

Last line: `sim_error_ttft_p50=X sim_error_tpot_p50=Y` (the largest over the runs; the
target is <= 0.2). The simulator does not model the router and the load generator
competing with the workers for this machine's two cores beyond what the serving
measurement saw at its load; the lines above it say how far off each run is.
(Part (b), autoscaling against a traffic shift, is not built yet.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common.entry import parse
from pdserve.bench.common.machine import machine_load
from pdserve.planner.profile import Profile
from pdserve.bench.common.stats import percentile
from pdserve.planner.simulator import Limits, Shape, SimRequest, Simulation
from pdserve.services.common.flags import flag

WORKLOADS = {"chat": ((64, 192), (32, 64)), "long": ((384, 768), (16, 48))}
SPLITS = {"1M": Shape(mixed=1), "1P+1D": Shape(prefill=1, decode=1, mixed=0, local_prefill_threshold=64)}
NUM_BLOCKS = 1024


@dataclass(frozen=True)
class Flags:
    quick: bool = flag(False, "fewer requests, a quick profile")
    requests: int | None = flag(None, "requests per run (default 64; 24 with --quick)")
    rate: float | None = flag(None, "requests per second (default 3)")
    seed: int = flag(0, "seed of the arrivals and prompts")


def run_cli(args: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"pdserve {' '.join(args[:1])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def measured(report: dict) -> tuple[list[SimRequest], dict[str, float]]:
    requests, ttfts, tpots = [], [], []
    for r in report["requests"]:
        if r["error"]:
            raise RuntimeError(f"bench request {r['index']} failed: {r['error']}")
        requests.append(SimRequest(r["started"], r["prompt_tokens"], r["requested_tokens"]))
        ttfts.append(r["ttft"])
        if r["output_tokens"] > 1:
            tpots.append(r["tpot"])
    return requests, _quantiles(ttfts, tpots)


def _quantiles(ttfts: list[float], tpots: list[float]) -> dict[str, float]:
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "tpot_p50": percentile(tpots, 50), "tpot_p90": percentile(tpots, 90)}


def simulated(profile: Profile, shape: Shape, requests: list[SimRequest]) -> dict[str, float]:
    limits = Limits(num_blocks=NUM_BLOCKS, block_size=profile.source.get("block_size", 16))
    outcomes = Simulation(profile, shape, limits).run(requests)
    return _quantiles([o.ttft for o in outcomes], [o.tpot for o in outcomes if len(o.token_times) > 1])


def main(argv: list[str] | None = None) -> int:
    flags = parse(Flags, argv, "python -m pdserve.bench.planner", __doc__)
    n = flags.requests or (24 if flags.quick else 64)
    rate = flags.rate or 3.0
    print(f"machine: {machine_load()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-planner-"))
    profile_path = work / "profile.json"
    run_cli(["profile", "--output", str(profile_path), "--torch-threads", "1", "--cpu-affinity", "0", "--serving",
             "--num-blocks", str(NUM_BLOCKS), *(["--quick"] if flags.quick else ["--repeats", "3"])])
    profile = Profile.read(profile_path)
    print(f"profile: {len(profile.prefill)} prefill and {len(profile.decode)} decode points, "
          f"isa {profile.source['machine']['isa']}", flush=True)
    errors: dict[str, list[float]] = {"ttft_p50": [], "tpot_p50": [], "ttft_p90": [], "tpot_p90": []}
    for name, (prompt, output) in WORKLOADS.items():
        for label, shape in SPLITS.items():
            out = work / f"{name}-{label}.json"
            run_cli(["bench", "--json", str(out), "--num-requests", str(n), "--request-rate", str(rate),
                     "--prompt-tokens", *map(str, prompt), "--output-tokens", *map(str, output), "--seed",
                     str(flags.seed), "--num-blocks", str(NUM_BLOCKS), "--torch-threads", "1",
                     "--prefill", str(shape.prefill), "--decode", str(shape.decode), "--mixed", str(shape.mixed),
                     "--num-warmup", "2", "--progress", "false"])
            requests, real = measured(json.loads(out.read_text()))
            sim = simulated(profile, shape, requests)
            cells = []
            for key in errors:
                error = abs(sim[key] - real[key]) / real[key]
                errors[key].append(error)
                cells.append(f"{key} {real[key] * 1000:.1f}/{sim[key] * 1000:.1f} ms ({error:+.0%})"
                             if sim[key] >= real[key] else
                             f"{key} {real[key] * 1000:.1f}/{sim[key] * 1000:.1f} ms (-{error:.0%})")
            print(f"{name:<5} {label:<6} measured/simulated: {'; '.join(cells)}", flush=True)
    print(f"sim_error_ttft_p50={max(errors['ttft_p50']):.3f} sim_error_tpot_p50={max(errors['tpot_p50']):.3f} "
          f"sim_error_ttft_p90={max(errors['ttft_p90']):.3f} sim_error_tpot_p90={max(errors['tpot_p90']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

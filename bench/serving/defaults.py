"""What do the defaults buy? `pdserve up` with default flags against the same launch
with other flags (by default `--torch-threads 1`, the default before issue 38), driven
by `pdserve bench` through the OpenAI completions API, interleaved and repeated.

    python -m pdserve.bench.serving.defaults                       # ~5 minutes on 2 cores
    python -m pdserve.bench.serving.defaults --other "--torch-threads 1 --dtype float32" --repeats 5
    python -m pdserve.bench.serving.defaults --quick               # the smoke test

Each repetition starts one cluster (`pdserve up --prefill 0 --decode 0 --mixed 1
--http-port 0` plus the side's flags), warms it up, runs `pdserve bench --backend
openai --request-rate inf --concurrency C` (random prompts, greedy, ignore_eos) and
stops it, then the same for the other side (A B A B ...: load that drifts hits both
alike). Printed per run: output throughput, TTFT and TPOT p50; then per metric the
median ratio default / other with its min-max over repetitions, and one line

    defaults_throughput_ratio=X defaults_tpot_p50_ratio=Y defaults_ttft_p50_ratio=Z

beside the machine's ISA (torch's CPU capability) and core count.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common.entry import parse
from pdserve.bench.common.stats import ratio_line
from pdserve.bench.serving.metrics import Headline
from pdserve.services.common.flags import flag

SIDES = ("default", "other")


@dataclass(frozen=True)
class DefaultsFlags:
    quick: bool = flag(False, "two short runs a side (the smoke test)")
    other: str = flag("--torch-threads 1", "the flags the default launch is compared with")
    repeats: int = flag(3, "repetitions (each runs both sides)")
    concurrency: int = flag(64, "requests in flight")
    num_requests: int = flag(128, "requests a run")
    prompt_tokens: int = flag(256, "prompt tokens of each request")
    output_tokens: int = flag(64, "output tokens of each request")
    num_blocks: int = flag(2048, "KV blocks of the worker (both sides)")


def launch(flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`pdserve up` with a mixed worker and the HTTP API; its OpenAI base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", "0", "--prefill", "0", "--decode", "0", "--mixed", "1",
         "--http-port", "0", *flags], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(log, "wb"),
        text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("openai "):
            return proc, line.split()[1]
    raise RuntimeError(f"pdserve up {' '.join(flags)} ended before serving; see {log}")


def measure(base_url: str, cfg: DefaultsFlags) -> Headline:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.serving.command", "--backend", "openai", "--base-url", base_url,
         "--request-rate", "inf", "--concurrency", str(cfg.concurrency), "--num-requests", str(cfg.num_requests),
         "--prompt-tokens", str(cfg.prompt_tokens), str(cfg.prompt_tokens), "--output-tokens",
         str(cfg.output_tokens), str(cfg.output_tokens), "--num-warmup", "4"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"pdserve bench failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    throughput = float(re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", out.stdout).group(1))
    last = re.search(r"ttft_p50_ms=(\S+) tpot_p50_ms=(\S+)", out.stdout)
    return Headline(throughput, float(last.group(1)), float(last.group(2)))


def main(argv: list[str] | None = None) -> int:
    import torch

    f = parse(DefaultsFlags, argv, "python -m pdserve.bench.serving.defaults", __doc__)
    if f.quick:
        f = DefaultsFlags(quick=True, other=f.other, repeats=1, concurrency=4, num_requests=8, prompt_tokens=32,
                          output_tokens=8, num_blocks=256)
    sides = {"default": [], "other": shlex.split(f.other)}
    print(f"machine: {torch.backends.cpu.get_cpu_capability()}, {len(os.sched_getaffinity(0))} CPUs; "
          f"default: pdserve up (no flags); other: {f.other}")
    print(f"workload: {f.num_requests} requests, {f.prompt_tokens} prompt / {f.output_tokens} output tokens, "
          f"{f.concurrency} in flight, OpenAI completions streamed; {f.repeats} repetitions, interleaved")
    runs: dict[str, list[Headline]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="pdserve-defaults-") as logs:
        for repeat in range(f.repeats):
            for side in SIDES:
                log = Path(logs) / f"{side}-{repeat}.log"
                proc, url = launch([*sides[side], "--num-blocks", str(f.num_blocks)], log)
                try:
                    run = measure(url, f)
                finally:
                    proc.terminate()
                    proc.wait(60)
                runs[side].append(run)
                print(f"[{repeat + 1}/{f.repeats}] {side:<8} {run.line()}", flush=True)
    pairs = list(zip(runs["default"], runs["other"]))
    tput, t = ratio_line("output throughput default/other", [(a.throughput, b.throughput) for a, b in pairs])
    tpot, p = ratio_line("TPOT p50 default/other", [(a.tpot_p50_ms, b.tpot_p50_ms) for a, b in pairs])
    ttft, q = ratio_line("TTFT p50 default/other", [(a.ttft_p50_ms, b.ttft_p50_ms) for a, b in pairs])
    print("\n".join((tput, tpot, ttft)))
    print(f"defaults_throughput_ratio={t:.3f} defaults_tpot_p50_ratio={p:.3f} defaults_ttft_p50_ratio={q:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

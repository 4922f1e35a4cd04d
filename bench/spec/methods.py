"""Speculative decoding benchmark: spec off vs ngram vs draft_model vs eagle3 on the embedded model.

Run `python -m pdserve.bench.spec.methods --threads 1` (3 repetitions, about 3 minutes on a CPU core;
more torch threads than free cores make every timing several times slower and erratic),
`--quick` (about 10 s; off, ngram and draft_model only), or on a GPU
`python -m pdserve.bench.spec.gpu` (larger random models).

    one LLMEngine per method, built once and warmed up; prefix caching off, so every
    repetition does the same work (prompts: bench/spec/workloads.py)
    for each repetition r:
      for each workload (grounded: the answer repeats the prompt; completion: free code):
        for each concurrency c:
          for each method, in an order rotated by r (off ngram draft, ngram draft off, ...):
            closed loop: c requests in flight in the method's engine, the next added as
            one finishes; greedy, EOS ignored, max_tokens each

Per workload, concurrency and method:
  TPOT           per request (finished - first token) / (output tokens - 1), the median
                 over requests; then the median over repetitions [min, max]
  throughput     output tokens / wall time of the closed loop (first add to last finish)
  cpu            output tokens / CPU time of this process in the loop: with one torch
                 thread (--threads 1) the engine's own work, which other processes on a
                 shared machine inflate far less than its wall time
  ratios         TPOT(off) / TPOT(method), throughput(method) / throughput(off) and the
                 same for cpu, each taken within a repetition, the median [min, max] over
                 repetitions
  acceptance     from the engine's SpecStats over the runs (all repetitions): rate =
                 accepted / draft tokens, length = 1 + accepted / drafts, by position =
                 verifications whose draft i was accepted / drafts; and tokens per step =
                 output tokens / (output tokens - accepted), what a sequence gained per
                 engine step counting the steps it had no draft (length counts only those
                 with one)
  lossless       every method's tokens == off's for the same prompt, concurrency and
                 repetition; any difference is printed (INCONSISTENT) and the exit status is 1

eagle3 drafts with the committed EAGLE-3 head of the embedded model
(models/pdserve-tiny-code-eagle3, scripts/train_eagle_head.py); with another --model it runs
only when --eagle-model names a head for that model. Before the last line, one line per
workload gives every speculating method's acceptance length over all its runs, and where
eagle3, draft_model and ngram all ran, one more gives them as `<workload>:
eagle_acceptance_length=X draft_acceptance_length=Y ngram_acceptance_length=Z` followed by
each one's (and spec-off's) median TPOT at concurrency 1 (`eagle_tpot_c1_ms=...`).

The last line: `tpot_ratio_c1=X throughput_ratio_c64=Y acceptance_length=Z`, ngram on the
grounded workload: X the TPOT ratio at concurrency 1, Y the throughput ratio at 64 (at the
highest concurrency run when 64 is not; the log says so), Z over all its runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pdserve.bench.spec import run


def main(argv: Sequence[str] | None = None) -> int:
    return run.main(argv, "python -m pdserve.bench.spec.methods", __doc__)


if __name__ == "__main__":
    sys.exit(main())

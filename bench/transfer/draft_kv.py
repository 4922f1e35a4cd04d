"""Where the draft model's KV for a prompt comes from, measured: computed on the decode
worker, or computed on the prefill worker and shipped.

    python -m pdserve.bench.transfer.draft_kv [--lengths 128,512] [--repeats 7]

For each prompt length it times, interleaved, the target's prefill (what the prefill
worker spends on the prompt) and the draft's (what either side would spend on the
draft's KV), and prints the draft's KV bytes and what shipping them costs at a stated
transfer rate. Computing on the decode worker costs the draft's prefill once per
request on the pool with spare compute; shipping costs the same computation on the
prefill pool (the one whose time is TTFT) plus the transfer.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, median
from pdserve.engine.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, ModelConfig
from pdserve.engine.model_runner import BatchItem, ModelRunner, kv_bytes_per_block
from pdserve.engine.spec.draft_model import DraftSeq

BLOCK = 16
FIRST_TOKEN = 5  # past the special tokens


def prefill_seconds(runner: ModelRunner, length: int) -> float:
    """One forward pass over a fresh `length`-token prompt."""
    seq = DraftSeq("bench", length, list(range(FIRST_TOKEN, FIRST_TOKEN + length)))
    started = time.perf_counter()
    runner.execute([BatchItem(seq, length, list(range(-(-length // BLOCK))))])
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wire-gbps", type=float, default=2.5, help="KV transfer rate, GB/s (ZeroMQ tcp loopback)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    runners = {}
    for name, path in (("target", args.model), ("draft", args.draft_model)):
        cfg = ModelConfig.from_dir(path)
        runners[name] = ModelRunner(path, cfg, torch.float32, torch.device("cpu"), BLOCK, max(lengths))
        runners[name].allocate_kv_cache(-(-max(lengths) // BLOCK))
        prefill_seconds(runners[name], 16)  # warm-up
    print(f"threads {args.threads}, repeats {args.repeats}, load {open('/proc/loadavg').read().split()[0]}")
    print(f"{'tokens':>6} {'target ms':>10} {'draft ms':>9} {'draft/target':>28} {'draft KV KiB':>12} {'ship ms':>8}")
    for length in lengths:
        runs = interleaved({name: (lambda rep, r=r: prefill_seconds(r, length)) for name, r in runners.items()},
                           args.repeats)
        kv = kv_bytes_per_block(runners["draft"].cfg, BLOCK, torch.float32) * -(-length // BLOCK)
        ratio = Ratio.paired(runs["draft"], runs["target"])
        print(f"{length:>6} {median(runs['target']) * 1e3:>10.2f} {median(runs['draft']) * 1e3:>9.2f} "
              f"{str(ratio):>28} {kv / 1024:>12.0f} {kv / args.wire_gbps / 1e6:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

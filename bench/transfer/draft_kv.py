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

import time
from dataclasses import dataclass

import torch

from pdserve.bench.common.entry import parse
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, median
from pdserve.engine.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, ModelConfig
from pdserve.engine.model_runner import BatchItem, ModelRunner, kv_bytes_per_block
from pdserve.engine.spec.draft_model import DraftSeq
from pdserve.services.common.flags import flag

BLOCK = 16
FIRST_TOKEN = 5  # past the special tokens


def prefill_seconds(runner: ModelRunner, length: int) -> float:
    """One forward pass over a fresh `length`-token prompt."""
    seq = DraftSeq("bench", length, list(range(FIRST_TOKEN, FIRST_TOKEN + length)))
    started = time.perf_counter()
    runner.execute([BatchItem(seq, length, list(range(-(-length // BLOCK))))])
    return time.perf_counter() - started


@dataclass(frozen=True)
class DraftKvFlags:
    model: str = flag(DEFAULT_MODEL, "target model directory")
    draft_model: str = flag(DEFAULT_DRAFT_MODEL, "draft model directory")
    lengths: tuple[int, ...] = flag((128, 512), "prompt lengths, comma-separated")
    repeats: int = flag(7, "interleaved repetitions per length")
    threads: int = flag(1, "torch threads")
    wire_gbps: float = flag(2.5, "KV transfer rate, GB/s (ZeroMQ tcp loopback)")


def main(argv: list[str] | None = None) -> int:
    args = parse(DraftKvFlags, argv, "python -m pdserve.bench.transfer.draft_kv", __doc__)
    torch.set_num_threads(args.threads)
    lengths = list(args.lengths)
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

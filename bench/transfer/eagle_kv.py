"""Where an EAGLE head's state for a remotely prefilled prompt comes from, measured.

    python -m pdserve.bench.transfer.eagle_kv [--lengths 128,512] [--repeats 7]

The decode worker's head needs, for a P-token prompt, its own KV of the prompt's
rows and the target's feature at the last position. Two ways to get them there:

    ship the features   the prefill worker sends the target's feature of every prompt
                        position (EAGLE-3: three layers' hidden states); the decode
                        worker runs the head over them (its catch-up) before drafting
    ship the head state the prefill worker runs the head over the prompt as it
                        prefills and sends the head's one-layer KV and one feature

Both run the same head computation; what differs is the bytes on the wire and which
pool pays for it. This prints, per prompt token, the target's KV bytes and each
option's extra bytes, for the embedded model and its head and, from their configs,
for Llama-3.1-8B with an EAGLE-3 head in bf16; and it times (interleaved) a prefill
worker's prompt with the head and without it: the difference is the head's catch-up,
which the other option puts on the decode worker, inside a decoding step of every
sequence batched with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdserve.bench.common.entry import parse
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, median
from pdserve.engine import SamplingParams
from pdserve.engine.config import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.services.common.flags import flag

FIRST_TOKEN = 5  # past the special tokens


def per_token_bytes(layers: int, kv_heads: int, head_dim: int, hidden: int, aux: int, head_kv_heads: int,
                    head_head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """(target KV, features, head state) bytes per prompt token."""
    return (layers * 2 * kv_heads * head_dim * itemsize, aux * hidden * itemsize,
            2 * head_kv_heads * head_head_dim * itemsize)


def prefill_seconds(engine: LLMEngine, length: int, rep: int) -> float:
    """One fresh prompt of `length` tokens through the engine, held as for shipping."""
    rid = f"bench-{rep}-{time.monotonic_ns()}"
    prompt = [FIRST_TOKEN + (rep * 7 + i) % 200 for i in range(length)]
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - started
    engine.release(rid)
    return seconds


@dataclass(frozen=True)
class EagleKvFlags:
    model: str = flag(DEFAULT_MODEL, "target model directory")
    head: str = flag(DEFAULT_EAGLE3_HEAD, "EAGLE-3 head directory")
    lengths: tuple[int, ...] = flag((128, 512), "prompt lengths, comma-separated")
    repeats: int = flag(7, "interleaved repetitions per length")
    threads: int = flag(1, "torch threads")


def main(argv: list[str] | None = None) -> int:
    args = parse(EagleKvFlags, argv, "python -m pdserve.bench.transfer.eagle_kv", __doc__)
    torch.set_num_threads(args.threads)
    lengths = list(args.lengths)
    spec = SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 4, "model": args.head})
    engines = {
        name: LLMEngine(EngineConfig(model=args.model, cache=CacheConfig(num_blocks=-(-max(lengths) // 16) + 8,
                                                                         enable_prefix_caching=False),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=max(lengths)),
                                     speculative=s))
        for name, s in (("plain", None), ("head", spec))
    }
    head = engines["head"]
    cfg, hspec = head.model_config, head.eagle_head.spec
    itemsize = head.runner.kv_cache.element_size()
    rows = {
        "embedded (fp32)": per_token_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                                           len(hspec.aux_layers), hspec.cfg.num_kv_heads, hspec.cfg.head_dim, itemsize),
        "Llama-3.1-8B + EAGLE-3 (bf16)": per_token_bytes(32, 8, 128, 4096, 3, 8, 128, 2),
    }
    print(f"{'per prompt token':<30} {'target KV B':>11} {'features B':>16} {'head state B':>16}")
    for name, (kv, feat, state) in rows.items():
        print(f"{name:<30} {kv:>11} {feat:>8} (+{100 * feat / kv:4.1f}%) {state:>8} (+{100 * state / kv:4.1f}%)")
    for e in engines.values():
        prefill_seconds(e, 16, -1)  # warm-up
    print(f"threads {args.threads}, repeats {args.repeats}, load {open('/proc/loadavg').read().split()[0]}")
    print(f"{'tokens':>6} {'prefill ms':>10} {'with head ms':>12} {'head catch-up ms':>16} {'with/without':>26}")
    for length in lengths:
        runs = interleaved({name: (lambda rep, e=e: prefill_seconds(e, length, rep)) for name, e in engines.items()},
                           args.repeats)
        plain, with_head = median(runs["plain"]), median(runs["head"])
        ratio = Ratio.paired(runs["head"], runs["plain"])
        print(f"{length:>6} {1e3 * plain:>10.1f} {1e3 * with_head:>12.1f} {1e3 * (with_head - plain):>16.1f} "
              f"{str(ratio):>26}")
        print(f"eagle_state_bytes={(length - 1) * rows['embedded (fp32)'][2] + hspec.feature_size * itemsize} "
              f"eagle_feature_bytes={length * rows['embedded (fp32)'][1]} tokens={length}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which worker gets a request: pure functions over a snapshot of worker load.

    decode:  fewest requests in flight from this router, then the longest cached
             prefix of the prompt, then the most free KV blocks
    prefill: longest cached prefix of the prompt (block hashes the worker reported
             caching) minus `queue_weight` tokens per request queued on it;
             or, as a baseline, round robin (--prefill-policy round_robin)
    local prefill on the decode worker when the prompt's part the decode worker
    has not cached is shorter than `threshold` tokens (conditional disaggregation)
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    worker_id: str
    inflight: int  # requests this router has sent and not seen finish
    running: int
    waiting: int
    free_blocks: int
    cached: AbstractSet[bytes]  # block hashes the worker last reported caching


def cached_prefix_tokens(block_hashes: Sequence[bytes], cached: AbstractSet[bytes], block_size: int) -> int:
    """Tokens of the longest run of the prompt's leading blocks found in `cached`."""
    n = 0
    for h in block_hashes:
        if h not in cached:
            break
        n += 1
    return n * block_size


def pick_decode(loads: Sequence[Load], block_hashes: Sequence[bytes], block_size: int) -> Load | None:
    def key(w: Load) -> tuple:
        return (w.inflight, -cached_prefix_tokens(block_hashes, w.cached, block_size), -w.free_blocks, w.worker_id)

    return min(loads, key=key, default=None)


def pick_prefill(
    loads: Sequence[Load], block_hashes: Sequence[bytes], block_size: int, queue_weight: int
) -> Load | None:
    def score(w: Load) -> tuple:
        hit = cached_prefix_tokens(block_hashes, w.cached, block_size)
        return (hit - queue_weight * (w.inflight + w.waiting), w.free_blocks, w.worker_id)

    return max(loads, key=score, default=None)


def pick_round_robin(loads: Sequence[Load], turn: int) -> Load | None:
    """The `turn`-th worker (mod their number) in worker-id order."""
    ordered = sorted(loads, key=lambda w: w.worker_id)
    return ordered[turn % len(ordered)] if ordered else None


def prefill_locally(prompt_len: int, decode_cached_tokens: int, threshold: int) -> bool:
    return prompt_len - decode_cached_tokens < threshold

"""Which worker gets a request: pure functions over a snapshot of worker load.

    decode:  fewest requests in flight from this router, then the best cached
             prefix of the prompt, then the most free KV blocks
    prefill: best cached prefix of the prompt (block hashes the worker reported
             caching) minus `queue_weight` tokens per request queued on it;
             or, as a baseline, round robin (--prefill-policy round_robin)
    local prefill on the decode worker when the prompt's part the decode worker
    has not cached (in any tier) is shorter than `threshold` tokens (conditional
    disaggregation)

"Best cached prefix" weighs each leading block by where the worker holds it, with
KV tiers below its pool (issue 36): a device hit skips the block's compute; a host
hit costs a copy up first; a disk hit a file read and a copy. So

    prompt blocks:   b0      b1      b2      b3      b4
    worker A:        device  device  host    host    -      score 16*(1+1+.5+.5) = 48
    worker B:        device  device  device  -       -      score 16*3           = 48
    worker C:        disk    disk    disk    disk    disk   score 16*5*.25       = 20

and the run stops at the first block in no tier (a later hit cannot be used).
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

NO_BLOCKS: AbstractSet[bytes] = frozenset()
# What a cached block is worth against computing it (1 = free, 0 = a miss).
DEVICE_WEIGHT, HOST_WEIGHT, DISK_WEIGHT = 1.0, 0.5, 0.25


@dataclass(frozen=True)
class Load:
    worker_id: str
    inflight: int  # requests this router has sent and not seen finish
    running: int
    waiting: int
    free_blocks: int
    cached: AbstractSet[bytes]  # block hashes the worker last reported caching (its device pool)
    host: AbstractSet[bytes] = NO_BLOCKS  # ... in its host tier (KV tiers on)
    disk: AbstractSet[bytes] = NO_BLOCKS  # ... in its disk tier


def cached_prefix_tokens(block_hashes: Sequence[bytes], cached: AbstractSet[bytes], block_size: int,
                         *lower: AbstractSet[bytes]) -> int:
    """Tokens of the longest run of the prompt's leading blocks found in `cached` or
    any of the `lower` tiers (what a worker's reservation counts as present)."""
    n = 0
    for h in block_hashes:
        if h not in cached and not any(h in tier for tier in lower):
            break
        n += 1
    return n * block_size


def block_weight(h: bytes, w: Load) -> float:
    """What `w` holding block `h` is worth: by its fastest tier; 0 when it holds none."""
    if h in w.cached:
        return DEVICE_WEIGHT
    if h in w.host:
        return HOST_WEIGHT
    return DISK_WEIGHT if h in w.disk else 0.0


def prefix_score(block_hashes: Sequence[bytes], w: Load, block_size: int) -> float:
    """The prompt's leading blocks `w` holds in any tier, each weighed by its tier, in
    tokens: a device-pool prefix scores its length; the same prefix in host memory
    scores less, on disk less still."""
    score = 0.0
    for h in block_hashes:
        weight = block_weight(h, w)
        if not weight:
            break
        score += weight
    return score * block_size


def pick_decode(loads: Sequence[Load], block_hashes: Sequence[bytes], block_size: int) -> Load | None:
    def key(w: Load) -> tuple:
        return (w.inflight, -prefix_score(block_hashes, w, block_size), -w.free_blocks, w.worker_id)

    return min(loads, key=key, default=None)


def pick_prefill(
    loads: Sequence[Load], block_hashes: Sequence[bytes], block_size: int, queue_weight: int
) -> Load | None:
    def score(w: Load) -> tuple:
        hit = prefix_score(block_hashes, w, block_size)
        return (hit - queue_weight * (w.inflight + w.waiting), w.free_blocks, w.worker_id)

    return max(loads, key=score, default=None)


def pick_round_robin(loads: Sequence[Load], turn: int) -> Load | None:
    """The `turn`-th worker (mod their number) in worker-id order."""
    ordered = sorted(loads, key=lambda w: w.worker_id)
    return ordered[turn % len(ordered)] if ordered else None


def prefill_locally(prompt_len: int, decode_cached_tokens: int, threshold: int) -> bool:
    return prompt_len - decode_cached_tokens < threshold

"""The pool of KV-cache blocks: pure mechanism, no policy.

Every block is in exactly one of two states:

    in use   ref_cnt > 0, not in the free queue
    free     ref_cnt == 0, in the free queue (it may still hold cached KV)

The free queue is an LRU: allocation takes from the head and evicts that block's
prefix-cache entry; a freed block that holds cached KV goes to the tail (kept as
long as possible), a freed block without a hash goes to the head (nothing is lost
by reusing it first). A cache hit on a free block takes it out of the queue.

An observer (the tiers below the pool, engine/offload/tiers.py) is told when a cached
block joins the free queue (`released`: its KV is final, it may be copied down) and
just before any block is reused by allocation (`evicting`: a copy out of it must not
be in flight once it is overwritten).

Every hash that enters the cache (`cache`) or leaves it (eviction on allocation,
`reset_cache`) is recorded in `events` (engine/kv_events.py), which the owner flushes
into numbered batches for the router; with caching off nothing is ever recorded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.hashing import BlockHash
from pdserve.engine.kv_events import KvEventLog


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Kept beside the hash so a hash collision can never return the wrong KV.
    token_ids: tuple[int, ...] | None = None


class PoolObserver(Protocol):
    def released(self, block: Block) -> None: ...

    def evicting(self, block: Block) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KvEventLog | None = None,
                 observer: PoolObserver | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events if events is not None else KvEventLog()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.observer = observer

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        """The block caching exactly these tokens under this hash, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache (possibly free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block] | None:
        """n fresh blocks with ref_cnt 1, or None (and nothing taken) if too few are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if self.observer is not None:
                self.observer.evicting(block)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)
                elif self.observer is not None:
                    self.observer.released(block)

    def cache(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        self.events.stored(block_hash)

    def reset_cache(self) -> None:
        """Forget every cached hash (all KV contents become anonymous)."""
        for block_hash, block in self._cached.items():
            block.block_hash = None
            block.token_ids = None
            self.events.removed(block_hash)
        self._cached.clear()

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self.events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = None

    def check_integrity(self) -> None:
        """Raise if the pool's accounting does not add up."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if in_use + len(self._free) != self.num_blocks:
            raise RuntimeError(f"pool: {in_use} in use + {len(self._free)} free != {self.num_blocks}")
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise RuntimeError(f"pool: block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in self._free):
                raise RuntimeError(f"pool: block {block.block_id} ref_cnt {block.ref_cnt} vs free queue")
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise RuntimeError(f"pool: cache entry for block {block.block_id} has a stale hash")

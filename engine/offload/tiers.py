"""The KV hierarchy below the device pool, as the engine sees it: one object that
watches the pool, copies blocks down, and brings them back up on a lookup.

The life of a block across tiers:

    device pool (engine/block_pool.py)
      computed, full, hashed -> cached; its requests end -> freed (ref_cnt 0, LRU tail)
         |  released(block): queued for a copy down (engine/offload/offloader.py)
         v
    host tier (engine/offload/host.py)       the worker copies it into a slot; the
         |                                   slot is served only once written
         |  evicted by the host policy: demoted (its bytes written to disk)
         v
    disk tier (engine/offload/disk.py)       one checked file per block; evicted by
                                             the disk policy: the file is deleted
    ...
    device pool reuses the block: evicting(block) cancels a queued copy, or waits
    for the one in flight (a block is never overwritten while it is read)

    a prefix lookup (engine/kv_cache.py) misses the device pool at block i:
      onload: blocks i.. found in host, else disk, are copied up into fresh device
      blocks and cached there, so the lookup goes on finding them as device hits
      (they count as computed prefix tokens exactly as a device hit does; the last
      prompt token is still always computed). Any failure or the deadline: the rest
      is recomputed.

Onload is synchronous, at admission, on the engine thread: on a CPU the "device"
is host memory and a block's copy up is one memcpy (disk: one file read); on a GPU
it is an H2D copy per block before the request's first step. Overlapping it with
other requests' compute (layer by layer) is left for later; the deadline bounds what
one admission may spend on it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.block_pool import Block, BlockPool
from pdserve.engine.offload.copier import BlockCopier, as_view
from pdserve.engine.offload.disk import DiskTier
from pdserve.engine.offload.host import HostTier
from pdserve.engine.offload.layout import KVLayout
from pdserve.engine.offload.offloader import Offloader
from pdserve.engine.offload.stats import Changed, OffloadCounters, OffloadStats

log = logging.getLogger(__name__)

HOST, DISK = "host", "disk"


class LowerTiers:
    def __init__(self, copier: BlockCopier, layout: KVLayout, host: HostTier | None, disk: DiskTier | None,
                 offloader: Offloader, counters: OffloadCounters, onload_timeout: float,
                 clock: Callable[[], float] = time.monotonic, persist: bool = False) -> None:
        self.copier = copier
        self.layout = layout
        self.host = host
        self.disk = disk
        self.offloader = offloader
        self.counters = counters
        self.onload_timeout = onload_timeout
        self.clock = clock
        self.persist = persist
        self._closed = False

    def watch(self, changed: Changed) -> None:
        """Follow every tier's blocks (stored, dropped) with `changed(tier, hash,
        stored)`: the engine's KV event log, so KV events name the tier."""
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.watch(changed)

    # -- the pool's observer (engine/block_pool.py: PoolObserver) ----------------------------------

    def released(self, block: Block) -> None:
        """A cached block joined the free queue: its KV is final; copy it down."""
        if block.block_hash is not None and block.token_ids is not None:
            self.offloader.submit(block.block_id, block.block_hash, block.token_ids)

    def evicting(self, block: Block) -> None:
        """The pool is about to reuse `block`."""
        self.offloader.cancel(block.block_id)

    # -- lookups ----------------------------------------------------------------------------------

    def locate(self, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[str]:
        """The tier of each block of the longest run, from the first, found below the
        device pool ("host" or "disk"); nothing is counted or pinned. For the services:
        a reservation's and the router's view of what a prefix would cost."""
        found: list[str] = []
        for h, tokens in zip(hashes, token_blocks):
            if self.host is not None and self.host.contains(h, tokens):
                found.append(HOST)
            elif self.disk is not None and self.disk.contains(h, tokens):
                found.append(DISK)
            else:
                break
        return found

    def onload(self, pool: BlockPool, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]],
               hold: Sequence[Block] = ()) -> int:
        """Copy the longest run of these blocks found below into fresh device blocks,
        cached there (free, at the LRU tail: the caller's device lookup takes them);
        how many. `hold`: device blocks the allocation must not take (the caller's
        hits before these). Never more than the pool has free; stops at the first
        failure or past the deadline."""
        found = self.locate(hashes, token_blocks)
        if not found:
            return 0
        pool.touch(hold)
        try:
            return self._onload(pool, hashes, token_blocks, min(len(found), pool.num_free_blocks))
        finally:
            pool.free(reversed(hold))

    def _onload(self, pool: BlockPool, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]], n: int) -> int:
        if n == 0:
            return 0
        started = self.clock()
        blocks = pool.allocate(n)
        assert blocks is not None  # n <= free
        done = 0
        try:
            for block, h, tokens in zip(blocks, hashes, token_blocks):
                if self.clock() - started > self.onload_timeout or not self._copy_up(h, tuple(tokens), block):
                    self.counters.onload_failures += 1
                    break
                pool.cache(block, h, tokens)
                done += 1
        finally:
            pool.free(reversed(blocks))  # cached ones to the tail (first block last), the rest to the head
        self.counters.onloaded_blocks += done
        self.counters.observe_onload(self.clock() - started)
        return done

    def count_miss(self) -> None:
        """An admission's lookup ended below the pool too: a miss in every tier (counted
        once per admission, as the pool's prefix-cache queries are)."""
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.count_miss()

    def _copy_up(self, block_hash: bytes, tokens: tuple[int, ...], block: Block) -> bool:
        try:
            if self.host is not None:
                slot = self.host.acquire(block_hash, tokens)
                if slot is not None:
                    try:
                        self.copier.to_device(self.host.store[slot], block.block_id)
                    finally:
                        self.host.release(block_hash)
                    return True
            if self.disk is not None:
                data = self.disk.read(block_hash, tokens)
                if data is not None:
                    self.copier.to_device(torch.frombuffer(data, dtype=torch.uint8), block.block_id)
                    return True
        except Exception as exc:  # recompute is always the fallback
            log.warning("kv offload: copying a block up failed (%s: %s): recomputed instead", type(exc).__name__, exc)
            return False
        return False

    # -- accounting -------------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        counted = {f.name: getattr(self.counters, f.name) for f in dataclasses.fields(OffloadStats)
                   if hasattr(self.counters, f.name)}
        return OffloadStats(
            host=self.host.stats() if self.host is not None else None,
            disk=self.disk.stats() if self.disk is not None else None,
            queue_depth=self.offloader.queue_depth, queue_capacity=self.offloader.depth,
            disk_writes_disabled=self.disk is not None and not self.disk.writable, **counted,
        )

    def take_latency_samples(self) -> tuple[list[float], list[float]]:
        """Offload and onload latencies (seconds) observed since the last call, each
        handed over once (for histograms)."""
        return _take(self.counters.offload_samples), _take(self.counters.onload_samples)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for every queued copy down (tests; a shutdown that wants them kept)."""
        return self.offloader.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker (queued copies are dropped); with a persistent disk tier,
        first write the host tier's blocks down to it (within `timeout`), so that a
        restarted engine finds them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.persist and self.host is not None and self.disk is not None:
            self.offloader.flush(timeout)
            self._spill(self.host, self.disk, self.clock() + timeout)
        self.offloader.close()
        if self.disk is not None:
            self.disk.close()

    def _spill(self, host: HostTier, disk: DiskTier, give_up: float) -> None:
        for block_hash, tokens, slot in host.ready_blocks():
            if self.clock() > give_up or not disk.writable:
                return
            if not disk.contains(block_hash, tokens):
                disk.write(block_hash, tokens, as_view(host.store[slot]))

    def check_integrity(self, idle: bool = True) -> None:
        self.offloader.check_integrity()
        if self.host is not None:
            self.host.check_integrity(idle)
        if self.disk is not None:
            self.disk.check_integrity()


def _take(samples: deque[float]) -> list[float]:
    """Every sample now in `samples`, removed (popleft: safe beside the worker's appends)."""
    out = []
    while samples:
        out.append(samples.popleft())
    return out

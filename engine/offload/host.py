"""The host-memory tier: a preallocated store of N block slots (pinned on a GPU host),
each shaped like one device block across all layers, indexed by block hash.

    slot states     free --begin_write--> writing --end_write--> ready
                     ^                       |  (failed)           |  acquire/release
                     +-----------------------+<---- evicted -------+  (readers pin it)

A slot is only ever found by a lookup once it is *ready*: a block is never read
while it is still being written. Eviction (the tier's policy, engine/offload/policy.py)
picks only ready, unpinned slots; `begin_write` hands the victim's hash and slot back
to the writer, which may demote its bytes to the disk tier before overwriting them.
Every method holds the tier's lock: the offload worker writes, the engine thread reads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.offload.layout import KVLayout
from pdserve.engine.offload.policy import EvictionPolicy
from pdserve.engine.offload.stats import Changed, TierCounters, TierStats, unwatched


@dataclass
class _Entry:
    slot: int
    token_ids: tuple[int, ...]
    ready: bool = False
    readers: int = 0


@dataclass(frozen=True)
class Victim:
    """A ready block evicted for room: its bytes sit in `slot` until the writer overwrites them."""

    block_hash: bytes
    token_ids: tuple[int, ...]
    slot: int


class HostTier:
    name = "host"

    def __init__(self, num_slots: int, layout: KVLayout, dtype: torch.dtype, policy: EvictionPolicy,
                 pin: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_offload_host_bytes: holds no block of {layout.block_bytes} bytes")
        self.num_slots = num_slots
        self.layout = layout
        self.policy = policy
        self.counters = TierCounters()
        self.store = torch.zeros((num_slots, *layout.shape), dtype=dtype, pin_memory=pin)
        self._entries: dict[bytes, _Entry] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 first
        self._lock = threading.Lock()
        self._changed: Changed = unwatched

    def watch(self, changed: Changed) -> None:
        """Tell `changed(tier, hash, stored)` each block that becomes servable here or
        leaves (KV events, engine/kv_events.py), starting with those here now."""
        with self._lock:
            self._changed = changed
            for block_hash, entry in self._entries.items():
                if entry.ready:
                    changed(self.name, block_hash, True)

    # -- writing (the offload worker) ---------------------------------------------------------

    def begin_write(self, block_hash: bytes, token_ids: Sequence[int]) -> tuple[int, Victim | None] | None:
        """A slot to write `block_hash` into (not visible to lookups until `end_write`),
        and the block evicted for it, if any. None: already here (or being written), or
        every slot is busy (being read or written)."""
        with self._lock:
            if block_hash in self._entries:
                self.policy.touch(block_hash)
                return None
            victim = None
            if self._free:
                slot = self._free.pop()
            else:
                key = self.policy.victim(self._evictable)
                if key is None:
                    return None
                old = self._entries.pop(key)  # type: ignore[arg-type]
                self._changed(self.name, key, False)  # type: ignore[arg-type]
                self.policy.evicted(key)
                self.counters.evicted += 1
                slot = old.slot
                victim = Victim(key, old.token_ids, slot)  # type: ignore[arg-type]
            self._entries[block_hash] = _Entry(slot, tuple(token_ids))
            return slot, victim

    def end_write(self, block_hash: bytes, ok: bool) -> None:
        """The slot's bytes are written (`ok`): lookups may find it; else it is freed."""
        with self._lock:
            entry = self._entries[block_hash]
            if not ok:
                del self._entries[block_hash]
                self._free.append(entry.slot)
                return
            entry.ready = True
            self._changed(self.name, block_hash, True)
            self.policy.insert(block_hash)
            self.counters.stored += 1
            self.counters.bytes_written += self.layout.block_bytes

    # -- reading (the engine thread) ----------------------------------------------------------

    def contains(self, block_hash: bytes, token_ids: Sequence[int] | None = None) -> bool:
        with self._lock:
            entry = self._entries.get(block_hash)
            return entry is not None and entry.ready and (token_ids is None or entry.token_ids == tuple(token_ids))

    def acquire(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The slot holding exactly these tokens' block, pinned until `release`; counts a
        hit or a miss."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or not entry.ready or entry.token_ids != tuple(token_ids):
                self.counters.misses += 1
                return None
            entry.readers += 1
            self.policy.touch(block_hash)
            self.counters.hits += 1
            self.counters.bytes_read += self.layout.block_bytes
            return entry.slot

    def count_miss(self) -> None:
        """A lookup that did not look here found nothing anywhere: a miss here too."""
        with self._lock:
            self.counters.misses += 1

    def release(self, block_hash: bytes) -> None:
        with self._lock:
            self._entries[block_hash].readers -= 1

    def ready_blocks(self) -> list[tuple[bytes, tuple[int, ...], int]]:
        """(hash, tokens, slot) of every ready block, least valuable first (by policy order
        where it keeps one)."""
        with self._lock:
            return [(h, e.token_ids, e.slot) for h, e in self._entries.items() if e.ready]

    def _evictable(self, key: object) -> bool:
        entry = self._entries.get(key)  # type: ignore[call-overload]
        return entry is not None and entry.ready and entry.readers == 0

    # -- accounting -----------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            used = self.num_slots - len(self._free)
            block = self.layout.block_bytes
            return self.counters.snapshot(self.num_slots, self.num_slots * block, used, used * block)

    def check_integrity(self, idle: bool = True) -> None:
        """Every slot is free or owned by exactly one block; the policy knows exactly the
        ready blocks. `idle`: nothing is being read or written now either."""
        with self._lock:
            owned = [e.slot for e in self._entries.values()]
            if len(set(owned)) != len(owned):
                raise RuntimeError("host tier: a slot is owned by two blocks")
            if set(owned) & set(self._free) or len(set(self._free)) != len(self._free):
                raise RuntimeError("host tier: a slot is both free and owned, or free twice")
            if len(owned) + len(self._free) != self.num_slots:
                raise RuntimeError(f"host tier: {len(owned)} owned + {len(self._free)} free != {self.num_slots} slots")
            ready = {h for h, e in self._entries.items() if e.ready}
            if len(self.policy) != len(ready) or any(h not in self.policy for h in ready):
                raise RuntimeError("host tier: the eviction policy and the ready blocks disagree")
            if idle and any(e.readers or not e.ready for e in self._entries.values()):
                raise RuntimeError("host tier: a block is still pinned or half written")

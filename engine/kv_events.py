"""KV events: what a prefix cache stored and removed, as a numbered stream of batches.

    engine thread                              subscribers (any thread)
    -------------                              ------------------------
    BlockPool.cache  -> stored(hash)
    BlockPool._evict -> removed(hash)          since(seq, epoch) -> batches after seq,
    flush() (once per loop iteration)   -->      or a snapshot when those are gone
      one KvEventBatch(seq + 1, ...)           wait(seq, timeout): until a batch after seq
      into a bounded buffer

Invariants:
  - `stored` and `removed` of a batch are disjoint: a hash stored and evicted again
    before the flush (or evicted and stored again) cancels out, so applying a batch
    in any order gives the cache as of its `seq`;
  - batches are numbered 1, 2, 3, ... without gaps within an `epoch` (one per log: a
    restarted worker has a new one), and the buffer keeps the last `capacity`;
  - `hashes` (what a snapshot returns) is the cache as of the last flushed batch.
Recording costs a dict operation on the engine thread and takes no lock; the lock is
taken once per flush and by subscribers.

With KV tiers below the pool (engine/offload/), the tiers' own changes ride in the same
batches, per tier (`lower`: host, disk): a hash stored into the host tier, dropped
from the disk tier... The offload worker records them from its own thread
(`tier_changed`, under a small lock of their own); the same cancelling and snapshot
rules hold per tier. The device pool's changes stay in `stored` / `removed`, so a
worker without tiers sends exactly what it sent before. A block may sit in several
tiers at once (copied down, still cached in the pool): a reader ranks them.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from dataclasses import dataclass

from pdserve.engine.hashing import BlockHash

DEFAULT_CAPACITY = 1024  # batches kept for subscribers that fall behind
DEVICE = "device"  # the pool's tier; the lower ones are named by engine/offload (host, disk)


@dataclass(frozen=True)
class TierChanges:
    """One lower tier's changes in a batch (a snapshot: its whole content, in `stored`)."""

    tier: str
    stored: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...] = ()


@dataclass(frozen=True)
class KvEventBatch:
    """Changes to the cache since batch `seq - 1`; with `snapshot`, the whole cache as
    of `seq` (in `stored`, and per lower tier in `lower`): replace, do not apply."""

    seq: int
    stored: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...] = ()
    snapshot: bool = False
    lower: tuple[TierChanges, ...] = ()  # only from an engine with KV tiers


def _split(pending: dict[BlockHash, bool]) -> tuple[tuple[BlockHash, ...], tuple[BlockHash, ...]]:
    return tuple(h for h, s in pending.items() if s), tuple(h for h, s in pending.items() if not s)


def _record(pending: dict[BlockHash, bool], block_hash: BlockHash, stored: bool) -> None:
    """Note a change; the opposite change still pending cancels out instead."""
    if pending.get(block_hash) is (not stored):
        del pending[block_hash]
    else:
        pending[block_hash] = stored


class KvEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.epoch = os.urandom(8).hex()
        self._pending: dict[BlockHash, bool] = {}  # hash -> stored (True) / removed (False) since the last flush
        self._cond = threading.Condition()
        self._batches: deque[KvEventBatch] = deque(maxlen=capacity)
        self._hashes: set[BlockHash] = set()
        self._seq = 0
        self._closed = False
        self._tier_lock = threading.Lock()  # the lower tiers record from the offload worker's thread
        self._tier_pending: dict[str, dict[BlockHash, bool]] = {}
        self._tier_hashes: dict[str, set[BlockHash]] = {}  # per lower tier, as of the last batch

    # -- engine thread ---------------------------------------------------------------

    def stored(self, block_hash: BlockHash) -> None:
        _record(self._pending, block_hash, True)

    def removed(self, block_hash: BlockHash) -> None:
        _record(self._pending, block_hash, False)

    def flush(self) -> int | None:
        """Publish what changed since the last flush as one batch; its seq, or None
        when nothing changed."""
        with self._tier_lock:
            tiers, self._tier_pending = self._tier_pending, {}
        lower = tuple(TierChanges(tier, *_split(pending)) for tier, pending in tiers.items() if pending)
        if not self._pending and not lower:
            return None
        stored, removed = _split(self._pending)
        self._pending.clear()
        with self._cond:
            self._seq += 1
            self._batches.append(KvEventBatch(self._seq, stored, removed, lower=lower))
            self._hashes.difference_update(removed)
            self._hashes.update(stored)
            for changes in lower:
                held = self._tier_hashes.setdefault(changes.tier, set())
                held.difference_update(changes.removed)
                held.update(changes.stored)
            self._cond.notify_all()
            return self._seq

    # -- the lower tiers (any thread) ---------------------------------------------------

    def tier_changed(self, tier: str, block_hash: BlockHash, stored: bool) -> None:
        """The lower tier `tier` stored (or dropped) `block_hash`; published with the
        next flush."""
        with self._tier_lock:
            _record(self._tier_pending.setdefault(tier, {}), block_hash, stored)

    # -- any thread ------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """The last batch published (0: none yet)."""
        with self._cond:
            return self._seq

    def since(self, seq: int, epoch: str = "") -> list[KvEventBatch]:
        """The batches after `seq` of `epoch`, in order; or, when some of them are no
        longer kept (or `epoch` is another log's: a new subscriber, a restarted
        worker), one snapshot batch of the whole cache at the current seq."""
        with self._cond:
            if epoch == self.epoch and 0 <= seq <= self._seq:
                if seq == self._seq:
                    return []
                first = self._batches[0].seq if self._batches else self._seq + 1
                if seq + 1 >= first:
                    return list(itertools.islice(self._batches, seq + 1 - first, None))
            lower = tuple(TierChanges(tier, tuple(held)) for tier, held in self._tier_hashes.items())
            return [KvEventBatch(self._seq, tuple(self._hashes), snapshot=True, lower=lower)]

    def wait(self, seq: int, timeout: float) -> bool:
        """Block until a batch after `seq` is published, the log is closed, or
        `timeout` seconds pass; whether there is a batch after `seq`."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > seq or self._closed, timeout)
            return self._seq > seq

    def close(self) -> None:
        """Wake every waiter for good (the worker is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

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
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from dataclasses import dataclass

from pdserve.engine.hashing import BlockHash

DEFAULT_CAPACITY = 1024  # batches kept for subscribers that fall behind


@dataclass(frozen=True)
class KvEventBatch:
    """Changes to the cache since batch `seq - 1`; with `snapshot`, the whole cache as
    of `seq` (in `stored`): replace, do not apply."""

    seq: int
    stored: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...] = ()
    snapshot: bool = False


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

    # -- engine thread ---------------------------------------------------------------

    def stored(self, block_hash: BlockHash) -> None:
        if self._pending.get(block_hash) is False:  # evicted and stored again: no change
            del self._pending[block_hash]
        else:
            self._pending[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        if self._pending.get(block_hash) is True:  # stored and evicted again: no change
            del self._pending[block_hash]
        else:
            self._pending[block_hash] = False

    def flush(self) -> int | None:
        """Publish what changed since the last flush as one batch; its seq, or None
        when nothing changed."""
        if not self._pending:
            return None
        stored = tuple(h for h, s in self._pending.items() if s)
        removed = tuple(h for h, s in self._pending.items() if not s)
        self._pending.clear()
        with self._cond:
            self._seq += 1
            self._batches.append(KvEventBatch(self._seq, stored, removed))
            self._hashes.difference_update(removed)
            self._hashes.update(stored)
            self._cond.notify_all()
            return self._seq

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
            return [KvEventBatch(self._seq, tuple(self._hashes), snapshot=True)]

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

"""Eviction policies of a lower KV tier, keyed by block hash: which block leaves when
the tier is full.

    insert(h)  a block entered the tier          touch(h)   a lookup hit it
    victim(ok) the block to evict next, among    evicted(h) the tier dropped the victim
               those `ok` allows (a block being  remove(h)  it left for another reason
               read or written is never one)                (corrupt, deleted)

Two policies, chosen per tier (`kv_offload_policy`):

  lru  least recently used first: one ordered map, O(1) everything.
  arc  Adaptive Replacement Cache (Megiddo and Modha, FAST '03), the frequency-aware
       one. Blocks seen once live in T1, blocks hit again in T2; ghost lists B1 and
       B2 remember the hashes recently evicted from each, and a ghost hit moves the
       target size p of T1 towards the list that would have kept it. Chosen over a
       reuse-count admission filter (vLLM's CPU tier's alternative) because it never
       refuses a block: in multi-turn chat the history a conversation resends has been
       offloaded exactly once before its next turn asks for it, so a filter that
       admits only blocks seen k times drops precisely the blocks that pay; ARC keeps
       them (T1) while a scan of one-off prompts cannot flush the blocks hit twice
       (T2), and it has no threshold to tune.

Policies are not thread-safe: their tier holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

POLICIES = ("lru", "arc")

Key = Hashable


class EvictionPolicy(Protocol):
    def insert(self, key: Key) -> None: ...

    def touch(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None: ...

    def evicted(self, key: Key) -> None: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        return next((k for k in self._order if evictable(k)), None)

    def evicted(self, key: Key) -> None:
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class ARCPolicy:
    """Adaptive Replacement Cache over `capacity` resident blocks.

        T1 (seen once) | T2 (hit again)      resident, |T1| + |T2| <= capacity
        B1             | B2                  ghosts: hashes only, |B1| + |B2| <= capacity
        p                                    T1's target size, moved by ghost hits
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        if key in self.b1:  # evicted from T1 too early: T1 should be larger
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # evicted from T2 too early: T2 should be larger
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        """Gone for good (corrupt, deleted): no ghost is kept."""
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """ARC's REPLACE: from T1 while it is over its target p, else from T2 (either,
        when the other has nothing evictable). The victim is not removed here: the tier
        calls `evicted` once it has really dropped the block."""
        first, second = (self.t1, self.t2) if len(self.t1) > max(self.p, 0.0) or not self.t2 else (self.t2, self.t1)
        for lst in (first, second):
            key = next((k for k in lst if evictable(k)), None)
            if key is not None:
                return key
        return None

    def evicted(self, key: Key) -> None:
        """The tier dropped `key`: it becomes a ghost of the list it left."""
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while len(self.b1) + len(self.b2) > self.capacity:
            (self.b1 if len(self.b1) >= len(self.b2) and self.b1 else self.b2).popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"kv_offload_policy: unknown {name!r}; choose one of {POLICIES}")

"""Target pool sizes: what `pdserve scale` sets and a launcher acts on.

    operator  --Scale(target)-->   router: PoolTargets   <--Scale(manager=id)--  launcher
                                                           (every ~0.5 s: reads the
                                                           targets, starts workers or
                                                           drains and stops them)

The router only keeps the numbers; it starts and stops nothing. A target is refused
(FAILED_PRECONDITION) while no launcher has read the targets within
MANAGER_TIMEOUT, so `pdserve scale` against a cluster nobody manages (hand-started
workers, a Kubernetes deployment scaled by its own replicas) fails instead of
silently doing nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping


POOLS = ("prefill", "decode", "mixed")
MAX_POOL_SIZE = 256
MANAGER_TIMEOUT = 10.0


class NoManager(RuntimeError):
    """No launcher reads the targets: setting one would change nothing."""


class PoolTargets:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._targets: dict[str, int] = {}
        self._manager = ""
        self._manager_seen = float("-inf")

    def read(self, manager: str) -> dict[str, int]:
        """A launcher's poll: records it as the pools' manager; returns the targets."""
        with self._lock:
            if manager:
                self._manager, self._manager_seen = manager, time.monotonic()
            return dict(self._targets)

    def manager(self) -> str:
        with self._lock:
            return self._manager if time.monotonic() - self._manager_seen < MANAGER_TIMEOUT else ""

    def set(self, target: Mapping[str, int], live: Mapping[str, int], manager: str) -> dict[str, int]:
        """Set the given pools' targets (by the manager itself, or by an operator while
        a manager is there). Raises ValueError naming the pool, or NoManager."""
        for pool, size in target.items():
            if size > MAX_POOL_SIZE:
                raise ValueError(f"{pool}: at most {MAX_POOL_SIZE} workers, got {size}")
        if not manager and not self.manager():
            raise NoManager("no launcher manages this cluster's pools (scale only clusters started by `pdserve up`)")
        with self._lock:
            after = {pool: target.get(pool, self._targets.get(pool, live.get(pool, 0))) for pool in POOLS}
            if after["decode"] + after["mixed"] < 1:
                raise ValueError(f"decode: a cluster needs a decode or mixed worker, got decode={after['decode']} "
                                 f"mixed={after['mixed']}")
            self._targets.update(target)
            if manager:
                self._manager, self._manager_seen = manager, time.monotonic()
            return dict(self._targets)

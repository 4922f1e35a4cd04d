"""When `pdserve up` restarts a child that died: exponential backoff, capped, per child.

    backoff = Backoff(first=0.5, cap=10.0)
    delay = backoff.died("decode-0", now)      # 0.5, 1, 2, 4, ... <= 10 s while it keeps dying
    backoff.due("decode-0", now)               # True once the delay has passed
    backoff.restarted("decode-0", now)         # counted; a child that then runs for
                                               # STABLE_AFTER seconds starts over at `first`

Pure bookkeeping (no processes, no clock of its own), so the policy is testable alone;
launch/cluster.py decides what a restart is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

STABLE_AFTER = 30.0  # seconds a restarted child must live before its backoff resets


@dataclass
class Backoff:
    first: float
    cap: float
    restarts: Counter[str] = field(default_factory=Counter)  # name -> restarts so far
    _streak: dict[str, int] = field(default_factory=dict)  # deaths without a stable run between
    _due: dict[str, float] = field(default_factory=dict)  # name -> earliest restart (monotonic)
    _started: dict[str, float] = field(default_factory=dict)

    def died(self, name: str, now: float) -> float:
        """Record a death; the delay before its restart."""
        if now - self._started.get(name, float("-inf")) >= STABLE_AFTER:
            self._streak[name] = 0
        streak = self._streak.get(name, 0)
        delay = min(self.cap, self.first * 2 ** streak)
        self._streak[name] = streak + 1
        self._due[name] = now + delay
        return delay

    def pending(self) -> list[str]:
        return list(self._due)

    def due(self, name: str, now: float) -> bool:
        return name in self._due and now >= self._due[name]

    def restarted(self, name: str, now: float) -> int:
        """Record a restart; how many `name` has had."""
        self._due.pop(name, None)
        self._started[name] = now
        self.restarts[name] += 1
        return self.restarts[name]

    def forget(self, name: str) -> None:
        """A child stopped on purpose: no restart pending for it."""
        self._due.pop(name, None)

    @property
    def total(self) -> int:
        return sum(self.restarts.values())

"""A clock that moves only when a test says so: what deadlines are measured with in
tests (EngineLoop, RequestTable and the KV connectors take a `clock`), so no test
waits for real time to pass or asserts how much did."""

from __future__ import annotations

import threading


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._now += seconds
            return self._now

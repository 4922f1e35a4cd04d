"""What the engine thread tells the reader of one request, in order.

    TokenEvent*  then exactly one of  FinishedEvent | FailedEvent

A `RequestStream` is the thread-safe queue between them: the engine thread puts,
one gRPC handler thread gets (with a timeout, never forever). It is bounded: a reader
that falls `max_batches` engine steps behind (its client stopped reading, so its
handler is stuck in a write) makes `put` refuse, and the engine loop ends the request
there and then (its blocks freed); only the final event always fits.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from pdserve.engine.engine import TokenDelta
from pdserve.engine.errors import FailureKind
from pdserve.engine.outputs import RequestOutput


@dataclass(frozen=True)
class TokenEvent:
    delta: TokenDelta


@dataclass(frozen=True)
class FinishedEvent:
    output: RequestOutput  # not mutated once put


# Why a request failed: the engine's own kinds (engine/errors.py), one vocabulary from
# the engine to the router's client (on the wire: services/common/failure.py).
Failure = FailureKind


@dataclass(frozen=True)
class FailedEvent:
    failure: Failure
    message: str


Event = TokenEvent | FinishedEvent | FailedEvent
# Engine steps' worth of events a reader may fall behind before its request ends:
# far more than a reader that is only slow needs (it takes every batch at each get).
MAX_BATCHES = 4096


class RequestStream:
    """Events go in batches (one engine step's worth), so a reader never sees a
    sequence's last token without the request's finish that came with it."""

    def __init__(self, request_id: str, max_batches: int = MAX_BATCHES) -> None:
        self.request_id = request_id
        self.max_batches = max_batches
        self._queue: queue.SimpleQueue[tuple[Event, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # batches put and not yet got

    def put(self, *events: Event, final: bool = False) -> bool:
        """Queue one step's events; False (nothing queued) when the reader is
        `max_batches` behind, unless `final` (the request's last event)."""
        with self._lock:
            if self._queued >= self.max_batches and not final:
                return False
            self._queued += 1
        self._queue.put(events)
        return True

    def get(self, timeout: float) -> list[Event]:
        """Every event available: waits up to `timeout` for the first, none after."""
        try:
            batches = [self._queue.get(timeout=max(timeout, 0.0))]
        except queue.Empty:
            return []
        while True:
            try:
                batches.append(self._queue.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._queued -= len(batches)
        return [event for batch in batches for event in batch]

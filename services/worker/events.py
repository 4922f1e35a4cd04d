"""What the engine thread tells the reader of one request, in order.

    TokenEvent*  then exactly one of  FinishedEvent | FailedEvent

A `RequestStream` is the thread-safe queue between them: the engine thread puts,
one gRPC handler thread gets (with a timeout, never forever).
"""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass

from pdserve.engine.engine import TokenDelta
from pdserve.engine.outputs import RequestOutput


@dataclass(frozen=True)
class TokenEvent:
    delta: TokenDelta


@dataclass(frozen=True)
class FinishedEvent:
    output: RequestOutput  # not mutated once put


class Failure(enum.Enum):
    ABORTED = "aborted"  # abort() / the reader went away
    SHUTDOWN = "shutdown"  # the worker stopped (its drain grace ran out) before the request ended
    EXPIRED = "expired"  # a reservation's KV did not arrive in time
    TRANSFER = "transfer"  # the KV transfer reported an error
    INTERNAL = "internal"  # the engine raised while stepping


@dataclass(frozen=True)
class FailedEvent:
    failure: Failure
    message: str


Event = TokenEvent | FinishedEvent | FailedEvent


class RequestStream:
    """Events go in batches (one engine step's worth), so a reader never sees a
    sequence's last token without the request's finish that came with it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[tuple[Event, ...]] = queue.SimpleQueue()

    def put(self, *events: Event) -> None:
        self._queue.put(events)

    def get(self, timeout: float) -> list[Event]:
        """Every event available: waits up to `timeout` for the first, none after."""
        try:
            events = list(self._queue.get(timeout=max(timeout, 0.0)))
        except queue.Empty:
            return []
        while True:
            try:
                events.extend(self._queue.get_nowait())
            except queue.Empty:
                return events

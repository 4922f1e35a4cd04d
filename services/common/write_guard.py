"""Cut off a server stream whose reader stopped reading.

A sync gRPC server resumes a response generator only once its previous message has
been written, and a write waits while HTTP/2 flow control is closed, i.e. while the
client reads nothing. So a client that stops reading parks the handler thread (and,
on a worker, the request's blocks) until the call's deadline, minutes away.

    handler thread                          guard thread (one per server)
    --------------                          ------------------------------
    for message in guarded(...):            every `period`: each write pending past
        pending[id] = now + timeout   --->  its deadline -> context.cancel(): the
        yield message  (the write)          write fails, the generator is closed,
        del pending[id]                     and its `finally` frees what it holds

The guard never cancels a stream that is only slow to produce (nothing pending then):
it times writes, not requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


class WriteGuard:
    def __init__(self, timeout: float, name: str, on_cut: Callable[[], None] | None = None) -> None:
        """`timeout`: longest a single message may take to be written; `on_cut` is
        told of each stream cut off (a metric)."""
        if timeout <= 0:
            raise ValueError(f"stream_write_timeout: must be > 0, got {timeout!r}")
        self.timeout = timeout
        self.name = name
        self.on_cut = on_cut
        self.cut = 0  # streams cut off so far
        self._ids = itertools.count()
        self._pending: dict[int, tuple[float, grpc.ServicerContext, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def guarded(self, messages: Iterator[T], context: grpc.ServicerContext, label: str) -> Iterator[T]:
        """`messages`, each write bounded by the timeout; closes `messages` on every
        way out (so its own `finally` runs at once, not at garbage collection)."""
        self._start()
        key = next(self._ids)
        try:
            for message in messages:
                with self._lock:
                    self._pending[key] = (time.monotonic() + self.timeout, context, label)
                yield message
                with self._lock:
                    self._pending.pop(key, None)
        finally:
            with self._lock:
                self._pending.pop(key, None)
            close = getattr(messages, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        self._stop.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name=f"{self.name}-write-guard", daemon=True)
                self._thread.start()

    def _watch(self) -> None:
        period = min(0.5, self.timeout / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                late = [(k, v) for k, v in self._pending.items() if v[0] <= now]
                for key, _ in late:
                    del self._pending[key]
            for _, (_, context, label) in late:
                log.warning("%s: %s: a message waited over %.1fs to be written (the client stopped reading): "
                            "cutting the stream off", self.name, label, self.timeout)
                self.cut += 1
                if self.on_cut is not None:
                    self.on_cut()
                context.cancel()

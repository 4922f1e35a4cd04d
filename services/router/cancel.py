"""One request's cancellation: the adapter's "my caller is gone" reaching the worker calls.

    adapter (any thread)           front end / dispatcher (the request's thread)
    --------------------           ---------------------------------------------
                                   call = stub.Decode(...); token.add_callback(call.cancel)
    client disconnected,    --->   token.cancel(): `cancelled` is True, every callback
    its deadline passed            runs (the worker calls fail at once, CANCELLED)
                                   request over (any way out): token.close(): every
                                   callback runs, `cancelled` stays as it was

Each callback runs once, outside the lock; one added after cancel or close runs at
once (a worker call started as its caller left is cancelled too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._cancelled = False
        self._closed = False

    @property
    def cancelled(self) -> bool:
        """Whether the caller went away (nobody to answer any more)."""
        return self._cancelled

    def cancel(self) -> None:
        """The caller is gone: cancel everything registered. Thread-safe, idempotent."""
        with self._lock:
            self._cancelled = True
        self._run()

    def close(self) -> None:
        """The request is over: cancel what is still registered (calls already done
        ignore it)."""
        with self._lock:
            self._closed = True
        self._run()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Run `callback` on cancel or close (at once if either happened already)."""
        with self._lock:
            if not (self._cancelled or self._closed):
                self._callbacks.append(callback)
                return
        callback()

    def _run(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

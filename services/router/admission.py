"""The router's admission: a bounded number of Generate calls in flight, and a short,
bounded, first-come-first-served wait for a slot.

    arrive --> slot free and nobody waiting? --yes--> run
                    | no
                    v
               queue full? --yes--> refuse (RESOURCE_EXHAUSTED + retry hint)
                    | no
                    v
               wait in line, at most max_wait (and the call's deadline)
                    slot handed over --> run ;  time up --> refuse

A released slot goes straight to the oldest waiter (no barging: a call arriving
just then cannot overtake the line).
"""

from __future__ import annotations

import collections
import threading


class _Waiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.granted = False


class Admission:
    def __init__(self, slots: int, max_queued: int, max_wait: float) -> None:
        if slots < 1 or max_queued < 0 or max_wait < 0:
            raise ValueError(f"max_concurrent_requests: admission needs slots >= 1, a queue >= 0 and a wait >= 0, "
                             f"got {slots}, {max_queued}, {max_wait}")
        self.slots = slots
        self.max_queued = max_queued
        self.max_wait = max_wait
        self._lock = threading.Lock()
        self._free = slots
        self._line: collections.deque[_Waiter] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._line)

    def acquire(self, longest: float) -> bool:
        """Take a slot, waiting in line at most min(max_wait, `longest`) seconds;
        False when the line is full or the wait ran out (the caller refuses)."""
        with self._lock:
            if self._free > 0 and not self._line:
                self._free -= 1
                return True
            if len(self._line) >= self.max_queued:
                return False
            waiter = _Waiter()
            self._line.append(waiter)
        waiter.event.wait(max(0.0, min(self.max_wait, longest)))
        with self._lock:
            if waiter.granted:
                return True
            self._line.remove(waiter)
            return False

    def release(self) -> None:
        with self._lock:
            if self._line:
                waiter = self._line.popleft()
                waiter.granted = True
                waiter.event.set()
            else:
                self._free += 1

    def retry_after(self) -> float:
        """Seconds a refused caller should wait before trying again: about one queue
        wait (slots free at the pace requests finish, which the router cannot know)."""
        return max(self.max_wait, 0.1)

"""Copying blocks down, off the engine's critical path: a bounded queue and one worker.

    engine thread                                  offload worker (a daemon thread)
    pool frees a cached block -> submit(block)     take the oldest job
      queue full: dropped, counted (never waits)     older than the deadline: expired
                                                     -> copying: device -> host slot
    pool reuses a block -> cancel(block)                (host victim -> disk first),
      queued:  cancelled, counted                       or device -> staging -> disk
      copying: waits for that one copy              -> done: the tier's entry is ready
      (one block's memcpy: the block is
       never overwritten while read)

A job is keyed by device block id; a block is queued at most once. Blocks already in
the first lower tier are not copied again (their policy is touched instead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.offload.copier import BlockCopier, as_view
from pdserve.engine.offload.disk import DiskTier
from pdserve.engine.offload.host import HostTier
from pdserve.engine.offload.stats import OffloadCounters

log = logging.getLogger(__name__)

_QUEUED, _COPYING, _CANCELLED = "queued", "copying", "cancelled"


@dataclass
class _Job:
    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    queued_at: float
    ready: Any  # the copier's mark
    state: str = _QUEUED


class Offloader:
    def __init__(self, copier: BlockCopier, host: HostTier | None, disk: DiskTier | None, counters: OffloadCounters,
                 depth: int, deadline: float, block_shape: tuple[int, ...], dtype: torch.dtype,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if host is None and disk is None:
            raise ValueError("kv offload: an offloader needs a host or a disk tier")
        self.copier = copier
        self.host = host
        self.disk = disk
        self.counters = counters
        self.depth = depth
        self.deadline = deadline
        self.clock = clock
        # device -> disk (no host tier), or a host victim's bytes on their way to the disk
        self._staging = torch.empty(block_shape, dtype=dtype) if disk is not None else None
        self._queue: deque[_Job] = deque()
        self._jobs: dict[int, _Job] = {}  # block id -> its job, queued or copying
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False  # the worker is inside a job (its disk write included)
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def _present(self, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        first = self.host if self.host is not None else self.disk
        assert first is not None
        return first.contains(block_hash, token_ids)

    def submit(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Queue a copy of a device block whose KV is final; False if not queued."""
        if self.disk is not None and self.host is None and not self.disk.writable:
            return False
        if self._present(block_hash, token_ids):
            return False
        with self._cond:
            if self._closed or block_id in self._jobs:
                return False
            if len(self._queue) >= self.depth:
                self.counters.offloads_dropped += 1
                return False
            job = _Job(block_id, block_hash, token_ids, self.clock(), self.copier.mark())
            self._jobs[block_id] = job
            self._queue.append(job)
            self._cond.notify_all()
        return True

    def cancel(self, block_id: int) -> None:
        """The pool is about to reuse `block_id`: its queued copy is cancelled, and a copy
        in flight finishes first (the block is not overwritten while it is read)."""
        with self._cond:
            job = self._jobs.get(block_id)
            if job is None:
                return
            if job.state == _QUEUED:
                job.state = _CANCELLED
                del self._jobs[block_id]
                self.counters.offloads_cancelled += 1
                return
            while self._jobs.get(block_id) is job:
                self._cond.wait()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued copy is done (tests, shutdown); False on timeout."""
        give_up = time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._queue or self._busy:
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in self._queue:
                if job.state == _QUEUED:
                    job.state = _CANCELLED
                    self._jobs.pop(job.block_id, None)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def check_integrity(self) -> None:
        with self._cond:
            if any(self._jobs.get(j.block_id) is not j for j in self._queue if j.state == _QUEUED):
                raise RuntimeError("offloader: a queued job is not tracked")

    # -- the worker -----------------------------------------------------------------------------

    def _next(self) -> _Job | None:
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                job = self._queue.popleft()
                if job.state == _CANCELLED:
                    continue
                if self.clock() - job.queued_at > self.deadline:
                    self.counters.offloads_expired += 1
                    self._jobs.pop(job.block_id, None)
                    self._cond.notify_all()
                    continue
                job.state = _COPYING
                self._busy = True
                return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._copy(job)
            except Exception as exc:  # a failed copy costs that block's offload, never the engine
                log.warning("kv offload: copying block %d down failed (%s: %s)", job.block_id, type(exc).__name__, exc)
            finally:
                self._release_device(job)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _copy(self, job: _Job) -> None:
        """Device -> host slot (a host victim's bytes to staging first, for the disk), or
        device -> staging; the device block is released before any disk write."""
        if self.host is None:
            assert self.disk is not None and self._staging is not None
            self.copier.to_host(job.block_id, self._staging, job.ready)
            self._release_device(job)
            if self.disk.write(job.block_hash, job.token_ids, as_view(self._staging)):
                self.counters.observe_offload(self.clock() - job.queued_at)
            return
        got = self.host.begin_write(job.block_hash, job.token_ids)
        if got is None:
            return
        slot, victim = got
        demote = victim is not None and self._staging is not None and self.disk is not None and self.disk.writable
        ok = False
        try:
            if demote:
                assert self._staging is not None
                self._staging.copy_(self.host.store[slot])
            self.copier.to_host(job.block_id, self.host.store[slot], job.ready)
            ok = True
        finally:
            self.host.end_write(job.block_hash, ok)
        self._release_device(job)
        self.counters.observe_offload(self.clock() - job.queued_at)
        if demote and victim is not None and self.disk is not None and self._staging is not None:
            self.disk.write(victim.block_hash, victim.token_ids, as_view(self._staging))

    def _release_device(self, job: _Job) -> None:
        """The device block has been read: the pool may reuse it (while a disk write goes on)."""
        with self._cond:
            if self._jobs.get(job.block_id) is job:
                del self._jobs[job.block_id]
            self._cond.notify_all()


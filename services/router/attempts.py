"""Attempts: a request (or its latest continuation) tried on one decode worker after
another until one serves it.

    for each attempt (another decode worker each time, at most --max-attempts):
        D = least loaded decode worker not tried yet (none left: wait up to
            --admission-timeout, within the deadline, for one to join or rejoin)
        stream the attempt on D (dispatch.py: the P/D seam), update by update
        D failed before anything reached the client: the next attempt
        D failed after a token (or the final update) reached it: `Broken`, and the
            caller decides (migration.py: continue elsewhere, or fail)
    no attempt left: RESOURCE_EXHAUSTED when a worker refused for want of room (it
    is there but full: back off and retry), else UNAVAILABLE, naming each failure;
    CANCELLED once the caller is gone.

Each try is an `Attempt` record: decode attempt number, prefill try, path. The
worker request id is derived from it in one place (`Attempt.worker_request_id`),
distinct for every decode attempt, prefill try and path, so a late abort of one
try can never hit the next:

    <job>-<attempt>              local prefill, or the first prefill try (remote)
    <job>-<attempt>-p<try>       the try-th prefill worker, with a reservation of its own
    ...-local                    D prefills after all (no P could take it, P failed, or the
                                 KV never came before a token)
    ...-kv                       D prefills after the KV was lost past the first token

The attempt number counts every decode worker tried for the request, across its
continuations (`tried`), so a continuation's ids never repeat its predecessors'.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol

from pdserve.services.common.deadline import Deadline
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.events import Update
from pdserve.services.router.failures import GONE, WorkerFailed
from pdserve.services.router.registry import WorkerHandle
from pdserve.services.router.validate import Job

log = logging.getLogger(__name__)


class Path(enum.Enum):
    """How an attempt's prompt reaches its decode worker's cache (the values are the
    `pdserve:router_prefill_path` labels)."""

    LOCAL = "local"  # D prefills it, chosen up front
    REMOTE = "remote"  # a prefill worker ships its KV into D's reservation
    FALLBACK = "fallback"  # D prefills it after all: no P could take it, or the KV never came before a token
    KV_LOST = "kv"  # D prefills it after the KV was lost past P's first token, continuing from that token


_SUFFIX = {Path.LOCAL: "", Path.REMOTE: "", Path.FALLBACK: "-local", Path.KV_LOST: "-kv"}


@dataclass
class Attempt:
    """One decode worker's try at a request, and within it the prefill tries."""

    job_id: str  # the job's worker request id
    number: int  # the decode attempt: 0, 1, ... (over the request's continuations)
    path: Path = Path.LOCAL
    prefill_try: int = 0  # REMOTE: the prefill worker tried (each with a reservation of its own)
    produced: bool = False  # a token reached the client
    decoded: bool = False  # the decode worker sent a token of its own
    kv_abandoned: bool = False  # its prefill worker died before D had the KV: D's reservation aborted

    @property
    def worker_request_id(self) -> str:
        """What the workers see (the module docstring lists the forms)."""
        prefill = f"-p{self.prefill_try}" if self.prefill_try else ""
        return f"{self.job_id}-{self.number}{prefill}{_SUFFIX[self.path]}"


class Broken(Exception):
    """The decode worker failed after something of its attempt reached the client."""

    def __init__(self, decode: WorkerHandle, error: WorkerFailed) -> None:
        super().__init__(str(error))
        self.decode = decode
        self.error = error


class DecodePool(Protocol):
    """What the attempts take from the worker registry (registry.py)."""

    def acquire_decode(
        self, block_hashes: Sequence[bytes], exclude: Collection[WorkerHandle]
    ) -> WorkerHandle | None: ...
    def wait_for_decode(self, exclude: Collection[WorkerHandle], timeout: float) -> bool: ...
    def release(self, handle: WorkerHandle) -> None: ...
    def probe_soon(self) -> None: ...


# One attempt on one decode worker: its updates (dispatch.py's P/D seam). Raises
# WorkerFailed when the worker failed as another may not, ServeError otherwise.
Serve = Callable[[WorkerHandle, Job, Attempt], Iterator[Update]]


class Attempts:
    def __init__(self, registry: DecodePool, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics

    def run(
        self, job: Job, serve: Serve, deadline: Deadline, cancel: Cancellation, tried: list[WorkerHandle],
        after: str = "",
    ) -> Iterator[Update]:
        """`job`'s updates from the first decode worker that serves it (the module
        docstring). `tried`: every decode worker tried for the request so far, never
        asked again; each one tried here is added. `after`: what a final error adds
        (a continuation's tokens and migrations). Raises Broken, or ServeError."""
        failures: list[str] = []
        busy = 0  # attempts refused for want of capacity
        admission = Deadline.after(min(self.config.admission_timeout, deadline.remaining()))
        for _ in range(self.config.max_attempts):
            decode = self._acquire(job, tried, admission, cancel)
            if decode is None:
                break
            attempt = Attempt(job.worker_request_id, len(tried))
            tried.append(decode)
            try:
                yield from self._one(decode, job, attempt, serve)
                return
            except WorkerFailed as e:
                self.registry.probe_soon()
                failures.append(f"{decode.worker_id}: {e}")
                busy += e.busy
                log.warning("request %s: %s; retrying on another worker", job.request_id, e)
                self.metrics.retry("decode")
            finally:
                self.registry.release(decode)
        if cancel.cancelled:
            raise ServeError(Status.CANCELLED, GONE)
        detail = ("; ".join(failures) if failures else "no decode worker is registered") + after
        if busy:  # a worker is up but full (the others tried failed): back off and retry
            raise ServeError(Status.RESOURCE_EXHAUSTED, f"the decode workers are full ({detail})")
        raise ServeError(Status.UNAVAILABLE, f"no decode worker could serve the request ({detail})")

    def _acquire(
        self, job: Job, tried: list[WorkerHandle], admission: Deadline, cancel: Cancellation
    ) -> WorkerHandle | None:
        """The next decode worker, booked; None when none is left (after waiting out
        `admission` for one to join) or the caller is gone."""
        while True:
            decode = self.registry.acquire_decode(job.block_hashes, tried)
            if decode is not None:
                self.metrics.worker_chosen(decode.worker_id, decode.role)
                return decode
            if not self.registry.wait_for_decode(tried, admission.remaining()) or cancel.cancelled:
                return None

    @staticmethod
    def _one(decode: WorkerHandle, job: Job, attempt: Attempt, serve: Serve) -> Iterator[Update]:
        """One attempt's updates; its worker's failure after something reached the
        client is Broken."""
        reached = False  # an update with tokens, or the final one, went out
        try:
            try:
                with closing(serve(decode, job, attempt)) as updates:
                    for update in updates:
                        reached = reached or update.finished
                        yield update
            except ValueError as e:  # "Channel closed": the registry dropped it just now
                if not decode.dropped:
                    raise
                raise WorkerFailed(f"worker {decode.worker_id} dropped ({e})") from None
        except WorkerFailed as e:
            if attempt.produced or reached:
                raise Broken(decode, e) from None
            raise

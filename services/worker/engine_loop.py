"""The one thread that owns an `LLMEngine` (the engine is not thread-safe).

    gRPC handler threads                       engine thread (EngineLoop._run)
    --------------------                       -------------------------------
    submit / reserve / call  --commands-->     run the command on the engine
    abort / commit / release                   step() while there is work
    stream.get(timeout)      <--events---      token deltas, finish, failure

Every request the loop has accepted has exactly one `RequestStream` until it ends:
finished (`FinishedEvent`), or failed (`FailedEvent`: aborted, reservation expired,
transfer failed, engine error, reader too far behind). Every path out frees the
request's blocks. A request the engine fails alone (engine/core.py) fails alone here.
Deadlines owned here:
  - a reservation (decode side) expires if its KV is not committed in time;
  - held exported blocks (prefill side) are released when their lease runs out;
  - a reserved request that ended before its stream was attached (its KV committed
    and its few tokens decoded, or it failed, before the Decode call came) keeps its
    stream, events and all, for `unclaimed_ttl` seconds, for that call to read.
The idle loop blocks on its command queue with a timeout, so it never spins (the
timeout is HELD_POLL instead of idle_wait while exported blocks wait for an ack).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from pdserve.engine.core import NO_ROOM_PREFIX
from pdserve.engine.engine import LLMEngine, Reservation, TokenDelta
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.common.metrics import Disabled, WorkerMetrics
from pdserve.services.common.stats import WorkerStats
from pdserve.services.worker.events import (
    MAX_BATCHES, Event, FailedEvent, Failure, FinishedEvent, RequestStream, TokenEvent,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
Command = Callable[[], None]
# While exported blocks wait for the receiver's ack, look for it this often (not every
# idle_wait): the blocks are freed, and the transfer timed, within a few ms.
HELD_POLL = 0.005


class EngineLoop:
    def __init__(
        self, engine: LLMEngine, *, idle_wait: float = 0.25, held_lease: float = 30.0,
        metrics: WorkerMetrics | None = None, unclaimed_ttl: float = 30.0, max_stream_batches: int = MAX_BATCHES,
    ) -> None:
        """`max_stream_batches`: engine steps' worth of events a request's reader may
        fall behind before the request ends (services/worker/events.py)."""
        self.engine = engine
        self.max_stream_batches = max_stream_batches
        self.metrics = metrics or Disabled()
        self.idle_wait = idle_wait
        self.held_lease = held_lease
        self.unclaimed_ttl = unclaimed_ttl
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Engine-thread state only (never touched from other threads):
        self._streams: dict[str, RequestStream] = {}
        self._unattached: set[str] = set()  # reserved, no reader yet
        self._unclaimed: dict[str, tuple[RequestStream, float]] = {}  # ended unattached -> (stream, drop at)
        self._reservations: dict[str, float] = {}  # request id -> monotonic deadline
        self._held: dict[str, float] = {}  # request id -> lease end
        self._batch: dict[str, tuple[RequestStream, list[Event]]] = {}  # this step's events
        self._pollers: list[Callable[[], None]] = []
        self._abort_hooks: list[Callable[[str], None]] = []
        # engine.stats() as of the last iteration, replaced whole (readers never block)
        self._snapshot = WorkerStats.of(engine.stats(), 0, time.monotonic())
        engine.token_hook = self._on_token

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; every open request fails with SHUTDOWN and is freed."""
        if not self._thread.is_alive():
            return
        self._commands.put(self._fail_all)
        self._stop.set()
        self._thread.join(timeout)

    @property
    def num_unattached(self) -> int:
        """Reservations whose Decode call has not come yet (read from any thread: a
        set's size, at worst one command stale)."""
        return len(self._unattached)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def add_poller(self, poll: Callable[[], None]) -> None:
        """Run `poll()` on the engine thread every iteration (at least every
        `idle_wait` s), e.g. a KV connector turning arrived pages into commits. Call
        before `start()`. An exception is logged and does not stop the loop."""
        self._pollers.append(poll)

    def add_abort_hook(self, hook: Callable[[str], bool | None]) -> None:
        """Run `hook(request_id)` on the engine thread before an aborted, expired or
        failed request's blocks are freed (a KV receiver must stop writing into them
        first). Called for every request that ends that way, so it must ignore ids it
        does not know. A hook that cannot stop a write into the blocks at once returns
        False: the loop then leaves them allocated, and the hook's owner frees them
        (`engine.abort`, on the engine thread, e.g. from a poller) once the write is
        over. Call before `start()`."""
        self._abort_hooks.append(hook)

    @property
    def on_engine_thread(self) -> bool:
        """Whether the caller is the engine thread (a poller, hook or command)."""
        return threading.current_thread() is self._thread

    def wake(self) -> None:
        """Make an idle loop run its pollers now rather than within `idle_wait`
        (thread-safe, never blocks: e.g. a KV receiver thread with news)."""
        self._commands.put(_nothing)

    # -- thread-safe API --------------------------------------------------------------

    def call(self, fn: Callable[[LLMEngine], T], timeout: float) -> T:
        """Run fn(engine) on the engine thread; its result, or its exception re-raised.
        Raises TimeoutError when the engine thread has not run it within `timeout`."""
        future: Future[T] = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:  # handed to the caller, who owns the request
                future.set_exception(e)

        if not self.alive:
            raise RuntimeError("engine loop: not running")
        self._commands.put(command)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"engine loop: no answer within {timeout:.1f}s") from None

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, timeout: float, export_kv: bool = False,
        first_token: int | None = None,
    ) -> RequestStream:
        """Queue a request to run here; its stream. Raises ValueError (bad input).
        `first_token`: see LLMEngine.add_request (its stream starts with that token)."""

        def add(engine: LLMEngine) -> RequestStream:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running")
            stream = self._open(request_id)  # before: a given first token is streamed at once
            try:
                outputs = engine.add_request(request_id, prompt, params, export_kv=export_kv, first_token=first_token)
            except BaseException:
                self._streams.pop(request_id, None)
                self._batch.pop(request_id, None)
                raise
            for output in outputs or ():
                self._finished(output)
            self._flush()
            return stream

        return self._call_or_abort(request_id, add, timeout)

    def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, lease: float, timeout: float
    ) -> Reservation:
        """Decode side: blocks for a prompt whose KV arrives remotely, until `lease`
        seconds pass without `commit_remote`. Its stream waits for `attach`.
        Raises ValueError (bad input) or NoCapacityError (no room now)."""

        def reserve(engine: LLMEngine) -> Reservation:
            reservation = engine.reserve_remote(request_id, prompt, params)
            self._open(request_id)
            self._unattached.add(request_id)
            self._reservations[request_id] = time.monotonic() + lease
            return reservation

        return self._call_or_abort(request_id, reserve, timeout)

    def attach(self, request_id: str, timeout: float) -> RequestStream:
        """The stream of a reserved request (once). Raises KeyError if there is none."""

        def attach(_engine: LLMEngine) -> RequestStream:
            if request_id in self._unattached:
                self._unattached.discard(request_id)
                return self._streams[request_id]
            ended = self._unclaimed.pop(request_id, None)
            if ended is None:
                raise KeyError(f"request_id: {request_id!r} has no reservation to stream")
            return ended[0]

        return self.call(attach, timeout)

    # commit_remote, fail and release take effect at once when called on the engine
    # thread (a poller, a hook); from any other thread they are queued.

    def commit_remote(self, request_id: str, first_token: int | None) -> None:
        """The reserved blocks hold the prompt's KV (the receiver says so): decode."""
        self._now_or_later(lambda: self._commit(request_id, first_token))

    def fail(self, request_id: str, failure: Failure, message: str) -> None:
        """End a request with an error (e.g. its transfer failed) and free its blocks."""
        self._now_or_later(lambda: self._end(request_id, failure, message))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (idempotent, asynchronous)."""
        self._commands.put(lambda: self._end(request_id, Failure.ABORTED, "aborted"))

    def abandon_reservation(self, request_id: str) -> None:
        """A reservation whose KV will not come (its sender is gone): fail it as a lost
        transfer if it is still waiting; a request whose KV arrived goes on."""

        def abandon() -> None:
            if request_id in self._reservations:
                self._end(request_id, Failure.TRANSFER, "the KV's sender is gone")

        self._commands.put(abandon)

    def release(self, request_id: str) -> None:
        """Prefill side: the exported KV has been shipped; free the held blocks."""
        self._now_or_later(lambda: self._release(request_id))

    def _now_or_later(self, command: Command) -> None:
        if self.on_engine_thread:
            command()
        else:
            self._commands.put(command)

    def snapshot(self) -> WorkerStats:
        """Load as of the engine thread's last iteration (`at`: when), without waiting
        for it: for heartbeats, which must not stall behind a long engine step."""
        return self._snapshot

    def stats(self, timeout: float, include_block_hashes: bool = False) -> WorkerStats:
        def stats(engine: LLMEngine) -> WorkerStats:
            hashes = tuple(engine.cached_block_hashes()) if include_block_hashes else ()
            return WorkerStats.of(engine.stats(), len(self._reservations), time.monotonic(), hashes)

        return self.call(stats, timeout)

    # -- engine thread ---------------------------------------------------------------

    def _call_or_abort(self, request_id: str, fn: Callable[[LLMEngine], T], timeout: float) -> T:
        try:
            return self.call(fn, timeout)
        except TimeoutError:
            self.abort(request_id)  # it may still run after we gave up: undo it then
            raise

    def _open(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, self.max_stream_batches)
        self._streams[request_id] = stream
        return stream

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands(block=not self.engine.has_scheduled_work())
            self._poll()
            self._expire(time.monotonic())
            if self.engine.has_scheduled_work() and not self._stop.is_set():
                self._step()
            self.engine.kv_events.flush()  # this iteration's cache changes, as one batch
            self._snapshot = WorkerStats.of(self.engine.stats(), len(self._reservations), time.monotonic())
        self._run_commands(block=False)

    def _run_commands(self, block: bool) -> None:
        wait = HELD_POLL if self._held else self.idle_wait
        try:
            command = self._commands.get(timeout=wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:  # a bug in a command must not take the engine thread down
                log.exception("engine loop command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        """One engine step. The engine keeps a failure to the requests behind it
        (engine/core.py: bisected forward pass, row-by-row sampling); a request it
        failed ends here with its own status. Should anything escape the engine
        anyway, only the requests of that step's batch fail (every request when the
        batch is unknown, or the engine no longer checks out), each logged by id."""
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        self.metrics.step(time.perf_counter() - start, self.engine.last_batch)
        for output in outputs:
            self._finished(output)
        self._flush()

    def _step_failed(self, error: Exception) -> None:
        # The batch, or (failed before it was known) every request the scheduler holds;
        # reservations waiting for their KV are in no batch and stay.
        suspects = list(self.engine.last_scheduled) or [r for r in self.engine.groups if r not in self._reservations]
        try:
            self.engine.check_integrity()
        except Exception:
            log.exception("engine state inconsistent after a failed step: failing every request")
            suspects = list(self._streams)
        log.error("engine step failed (%s: %s): failing requests %s", type(error).__name__, error, suspects,
                  exc_info=error)
        for request_id in suspects:
            self._end(request_id, Failure.INTERNAL, f"engine: {type(error).__name__}: {error}")

    def _poll(self) -> None:
        for poll in self._pollers:
            try:
                poll()
            except Exception:
                log.exception("engine loop poller failed")

    def _emit(self, stream: RequestStream, event: Event) -> None:
        self._batch.setdefault(stream.request_id, (stream, []))[1].append(event)

    def _flush(self) -> None:
        """Hand each stream this step's events in one batch. A stream whose reader is
        too far behind (its client stopped reading) ends here, its blocks freed."""
        behind = []
        for stream, events in self._batch.values():
            final = isinstance(events[-1], (FinishedEvent, FailedEvent))
            if not stream.put(*events, final=final):
                behind.append(stream.request_id)
        self._batch.clear()
        for request_id in behind:
            log.warning("request %s: its reader is %d engine steps behind: ending it", request_id,
                        self.max_stream_batches)
            self._end(request_id, Failure.ABORTED, "the client stopped reading the stream")

    def _on_token(self, delta: TokenDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is not None:
            self._emit(stream, TokenEvent(delta))

    def _finished(self, output: RequestOutput) -> None:
        stream = self._streams.pop(output.request_id, None)
        self._keep_unattached(output.request_id, stream)
        self._reservations.pop(output.request_id, None)
        if output.request_id in self.engine.held:
            self._held[output.request_id] = time.monotonic() + self.held_lease
        self.metrics.request_finished(output.times)
        if stream is None:
            return
        if output.error is None:
            self._emit(stream, FinishedEvent(output))
        else:  # the engine failed this request (alone): its tokens so far, then why
            failure = Failure.NO_ROOM if output.error.startswith(NO_ROOM_PREFIX) else Failure.INTERNAL
            self._emit(stream, FailedEvent(failure, output.error))

    def _commit(self, request_id: str, first_token: int | None) -> None:
        if self._reservations.pop(request_id, None) is None:
            log.warning("commit for %r, which has no live reservation (expired or aborted)", request_id)
            return
        try:
            outputs = self.engine.commit_remote(request_id, first_token)
        except Exception as e:
            self._end(request_id, Failure.INTERNAL, f"commit: {e}")
            return
        for output in outputs:
            self._finished(output)
        self._flush()

    def _end(self, request_id: str, failure: Failure, message: str) -> None:
        self._flush()  # tokens already told go before the failure
        deferred = False
        for hook in self._abort_hooks:
            try:
                deferred |= hook(request_id) is False
            except Exception:
                log.exception("abort hook failed for %r", request_id)
        if not deferred:  # else a write into them is ending: the hook's owner frees them
            self.engine.abort(request_id)  # frees running, waiting, reserved and held blocks
        self._held.pop(request_id, None)
        self._reservations.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        self._keep_unattached(request_id, stream)
        if stream is not None:
            stream.put(FailedEvent(failure, message), final=True)

    def _keep_unattached(self, request_id: str, stream: RequestStream | None) -> None:
        """A request ending before `attach`: its stream waits for it (unclaimed_ttl)."""
        if request_id in self._unattached:
            self._unattached.discard(request_id)
            if stream is not None:
                self._unclaimed[request_id] = (stream, time.monotonic() + self.unclaimed_ttl)

    def _release(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self.engine.release(request_id)

    def _expire(self, now: float) -> None:
        for request_id, deadline in list(self._reservations.items()):
            if now >= deadline:
                log.warning("reservation %r expired before its KV arrived", request_id)
                self.metrics.reservation_expired()
                self._end(request_id, Failure.EXPIRED, "reservation expired before its KV arrived")
        for request_id, deadline in list(self._held.items()):
            if now >= deadline:
                log.warning("lease on the exported KV of %r ran out: releasing", request_id)
                self._release(request_id)
        for request_id, (_, drop_at) in list(self._unclaimed.items()):
            if now >= drop_at:
                del self._unclaimed[request_id]

    def _fail_all(self) -> None:
        for request_id in list(self._streams) + list(self._held):
            self._end(request_id, Failure.SHUTDOWN, "worker is shutting down")


def _nothing() -> None:
    """A command that only wakes the loop."""

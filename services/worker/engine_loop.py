"""The one thread that owns an `LLMEngine` (the engine is not thread-safe).

    gRPC handler threads                       engine thread (EngineLoop._run)
    --------------------                       -------------------------------
    submit / reserve / call  --commands-->     run the command on the request table
    abort / release ...                        poll the KV connector, deadlines,
                                               step() while there is work
    stream.get(timeout)      <--events---      token deltas, finish, failure
    KV receiver thread       --wake------>     (the connector has news)

Every request lives in the loop's RequestTable (services/worker/requests.py): one
record, one state, one deadline, freed on every path out; a request the engine fails
alone (engine/core.py) fails alone there. This module only runs it: commands in,
the table's turn (`advance`) once per iteration, the KV connector started and closed
with the thread. The idle loop blocks on its command queue with a timeout, so it
never spins (the timeout is HELD_POLL instead of idle_wait while exported blocks wait
for an ack, which is looked for by polling).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from pdserve.engine.engine import LLMEngine, Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.connector import KVConnector
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.services.common.metrics import WorkerMetrics
from pdserve.services.common.stats import WorkerStats
from pdserve.services.worker.events import MAX_BATCHES, RequestStream
from pdserve.services.worker.requests import AWAITING_KV, RequestTable, State

log = logging.getLogger(__name__)
T = TypeVar("T")
Command = Callable[[], None]
# While exported blocks wait for the receiver's ack, look for it this often (not every
# idle_wait): the blocks are freed, and the transfer timed, within a few ms.
HELD_POLL = 0.005


class EngineLoop:
    def __init__(
        self, engine: LLMEngine, *, connector: KVConnector | None = None, clock: Callable[[], float] = time.monotonic,
        idle_wait: float = 0.25, held_lease: float = 30.0, metrics: WorkerMetrics | None = None,
        unclaimed_ttl: float = 30.0, max_stream_batches: int = MAX_BATCHES,
    ) -> None:
        """`clock` times every deadline (reservations, held leases, unclaimed streams);
        `connector` moves KV (none: this worker neither reserves for nor ships KV)."""
        self.engine = engine
        self.clock = clock
        self.idle_wait = idle_wait
        self.requests = RequestTable(engine, connector, clock=clock, held_lease=held_lease,
                                     unclaimed_ttl=unclaimed_ttl, max_stream_batches=max_stream_batches,
                                     metrics=metrics)
        self.connector = self.requests.connector
        self.metrics = self.requests.metrics
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._pollers: list[Callable[[], None]] = []
        # engine.stats() as of the last iteration, replaced whole (readers never block)
        self._snapshot = self._stats()

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> "EngineLoop":
        """Start the KV connector (its receiver wakes this loop) and the thread."""
        self.connector.start(self.wake)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; every open request fails with SHUTDOWN and is freed; then
        the KV connector closes."""
        if self._thread.is_alive():
            self._commands.put(self.requests.close)
            self._stop.set()
            self._thread.join(timeout)
        self.connector.close()

    @property
    def num_unattached(self) -> int:
        """Reservations whose Decode call has not come yet (read from any thread: an
        int, at worst one command stale)."""
        return self.requests.num_unattached

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def receives_kv(self) -> bool:
        """Whether this worker can reserve blocks for KV computed elsewhere."""
        return self.connector.decode is not None

    @property
    def ships_kv(self) -> bool:
        """Whether this worker can ship the KV it computes."""
        return self.connector.prefill is not None

    def add_poller(self, poll: Callable[[], None]) -> None:
        """Run `poll()` on the engine thread every iteration (at least every
        `idle_wait` s), before the request table's turn. Call before `start()`. An
        exception is logged and does not stop the loop."""
        self._pollers.append(poll)

    @property
    def on_engine_thread(self) -> bool:
        """Whether the caller is the engine thread (a poller or a command)."""
        return threading.current_thread() is self._thread

    def wake(self) -> None:
        """Make an idle loop take its turn now rather than within `idle_wait`
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
        self, request_id: str, prompt: list[int], params: SamplingParams, timeout: float, *,
        plan: TransferPlan | None = None, export_kv: bool = False, first_token: int | None = None,
        block_hashes: Sequence[bytes] = (),
    ) -> RequestStream:
        """Queue a request to run here; its stream (RequestTable.submit: `plan` ships
        its KV). Raises ValueError (bad input) or TransferError (the plan's receiver
        is out of reach)."""
        return self._call_or_abort(request_id, lambda _e: self.requests.submit(
            request_id, prompt, params, plan=plan, export_kv=export_kv, first_token=first_token,
            block_hashes=block_hashes), timeout)

    def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, lease: float, timeout: float,
        block_hashes: Sequence[bytes] = (),
    ) -> tuple[Reservation, bytes]:
        """Decode side: blocks for a prompt whose KV arrives remotely, until `lease`
        seconds pass without it, and the transfer plan for its sender. Its stream
        waits for `attach`. Raises ValueError (bad input) or NoCapacityError (no room)."""
        return self._call_or_abort(
            request_id, lambda _e: self.requests.reserve(request_id, prompt, params, lease, block_hashes), timeout)

    def attach(self, request_id: str, timeout: float) -> RequestStream:
        """The stream of a reserved request (once). Raises KeyError if there is none."""
        return self.call(lambda _e: self.requests.attach(request_id), timeout)

    # commit_remote and release take effect at once when called on the engine thread
    # (a poller, a command); from any other thread they are queued.

    def commit_remote(self, request_id: str, first_token: int | None) -> None:
        """The reserved blocks hold the prompt's KV (a loop without a KV connector:
        whoever filled them says so): decode."""
        self._now_or_later(lambda: self.requests.commit(request_id, first_token))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (idempotent, asynchronous)."""
        self._commands.put(lambda: self.requests.abort(request_id))

    def abandon_reservation(self, request_id: str) -> None:
        """A reservation whose KV will not come (its sender is gone): fail it as a lost
        transfer if it is still waiting; a request whose KV arrived goes on."""
        self._commands.put(lambda: self.requests.abandon(request_id))

    def release(self, request_id: str) -> None:
        """Prefill side: the exported KV has been shipped; free the held blocks."""
        self._now_or_later(lambda: self.requests.release(request_id))

    def _now_or_later(self, command: Command) -> None:
        if self.on_engine_thread:
            command()
        else:
            self._commands.put(command)

    def snapshot(self) -> WorkerStats:
        """Load as of the engine thread's last iteration (`at`: when, on the loop's
        clock), without waiting for it: for heartbeats, which must not stall behind a
        long engine step."""
        return self._snapshot

    def stats(self, timeout: float, include_block_hashes: bool = False) -> WorkerStats:
        def stats(engine: LLMEngine) -> WorkerStats:
            return self._stats(tuple(engine.cached_block_hashes()) if include_block_hashes else ())

        return self.call(stats, timeout)

    # -- engine thread ---------------------------------------------------------------

    def _stats(self, cached_block_hashes: tuple[bytes, ...] = ()) -> WorkerStats:
        return WorkerStats.of(self.engine.stats(), self.requests.count(*AWAITING_KV), self.clock(), cached_block_hashes)

    def _call_or_abort(self, request_id: str, fn: Callable[[LLMEngine], T], timeout: float) -> T:
        try:
            return self.call(fn, timeout)
        except TimeoutError:
            self.abort(request_id)  # it may still run after we gave up: undo it then
            raise

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands(block=not self.engine.has_scheduled_work())
            self._poll()
            if not self._stop.is_set():
                self.requests.advance()
            self.engine.kv_events.flush()  # this iteration's cache changes, as one batch
            self._snapshot = self._stats()
        self._run_commands(block=False)

    def _run_commands(self, block: bool) -> None:
        wait = HELD_POLL if self.requests.count(State.HELD) else self.idle_wait
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

    def _poll(self) -> None:
        for poll in self._pollers:
            try:
                poll()
            except Exception:
                log.exception("engine loop poller failed")


def _nothing() -> None:
    """A command that only wakes the loop."""

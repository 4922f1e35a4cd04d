"""Every request a worker's engine thread has accepted: one record each, with one
state and one deadline, and the one place that moves it and frees what it holds.

    submit ──> QUEUED ──scheduled──> RUNNING ──finished──> FINISHED
                 ^                      │ finished, KV exported: blocks held
                 │ KV arrived           v
    reserve ──> RESERVED ──pages──> RECEIVING        HELD ──acked──> FINISHED
                 (decode: blocks for a prompt whose KV comes from a prefill worker)

    every live state ──abort, deadline, transfer failed, engine error,
                        reader gone, shutdown──> FAILED

The deadline is the state's: a reservation's lease (RESERVED, RECEIVING: FAILED as
EXPIRED when it passes), the held blocks' lease (HELD: released unacknowledged),
and, for a reserved request that ended before its Decode call attached to it, how
long its stream waits for that call (`unclaimed_ttl`, after FINISHED or FAILED).
QUEUED and RUNNING have none here: their caller's RPC deadline aborts them.

A record owns its KV transfer: a decode reservation's `record.transfer` and a
prefill export's `record.export` are the connector's own objects (kvtransfer/transfer.py
`Transfer`, `Export`, whose phases are drawn there), not copies; the connector and
the receiver's inbox index the same objects. The engine keeps only what scheduling
needs (the request's blocks and its WAITING_FOR_REMOTE_KV status).

`_move` is the only place a state changes (an illegal move raises
IllegalTransition), `_end` the only way out: it tells the stream (a request's last
event goes out exactly once) and calls `_free`, the one function that lets go of
what a record holds on every way out: the connector stops first (a prefill
worker's sender tells its receiver, a decode worker's receiver forgets the
reservation), then the engine frees the blocks (`engine.abort` frees running,
waiting, reserved and held blocks alike). "Cancelled while pages are landing" is one
fact, the transfer's phase CANCELLING: the record then stays, ended, holding its
transfer and blocks, until the connector reports the write over, and `_free` runs
again:

    ended record ──_free──> connector.cancel ──True──> engine.abort, record forgotten
                                    └──False (CANCELLING)──> kept ──write over──> _free

No other lifecycle or deadline exists: a transfer has none of its own.

Engine thread only (services/worker/engine_loop.py runs it; bench/transfer/kvtransfer.py
drives one by hand): nothing here is locked, except what other threads read
(`num_unattached`, a plain int). A transfer's progress fields are the receiver
thread's, under its inbox's lock; this module never reads them, it only holds the
transfer until the connector reports it over (kvtransfer/transfer.py says which
thread owns which field).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.spec.draft_state import DraftState
from pdserve.engine.engine import LLMEngine, Reservation, TokenDelta
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.connector import KVConnector
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transfer import Export, Transfer
from pdserve.kvtransfer.wire import TransferError
from pdserve.services.common.metrics import Disabled, WorkerMetrics
from pdserve.services.worker.events import (
    MAX_BATCHES, Event, FailedEvent, Failure, FinishedEvent, RequestStream, TokenEvent,
)

log = logging.getLogger(__name__)


class State(enum.Enum):
    QUEUED = "queued"  # in the engine's scheduler, not scheduled yet
    RESERVED = "reserved"  # decode: blocks reserved, its KV comes from a prefill worker
    RECEIVING = "receiving"  # decode: pages of its KV are landing
    RUNNING = "running"  # the engine has scheduled it (a preempted request stays RUNNING)
    HELD = "held"  # prefill: finished; its blocks wait for the receiver's ack
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (State.FINISHED, State.FAILED)


_LIVE = (State.QUEUED, State.RESERVED, State.RECEIVING, State.RUNNING, State.HELD)
MOVES: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.RUNNING, State.FINISHED, State.FAILED}),
    State.RESERVED: frozenset({State.RECEIVING, State.QUEUED, State.FAILED}),
    State.RECEIVING: frozenset({State.QUEUED, State.FAILED}),
    State.RUNNING: frozenset({State.HELD, State.FINISHED, State.FAILED}),
    State.HELD: frozenset({State.FINISHED, State.FAILED}),
    State.FINISHED: frozenset(),
    State.FAILED: frozenset(),
}
AWAITING_KV = (State.RESERVED, State.RECEIVING)


class IllegalTransition(RuntimeError):
    """A move the state machine does not have (a bug in the caller, never input)."""


@dataclass(eq=False)
class Record:
    """One request on this worker."""

    request_id: str
    stream: RequestStream
    state: State
    deadline: float | None = None  # the state's deadline (see the module docstring), on the table's clock
    attached: bool = True  # its stream has a reader (a reservation's, once its Decode call attaches)
    closed: bool = False  # its stream has had its last event
    export: Export | None = None  # prefill: its KV export (kvtransfer/transfer.py) while the connector ships it
    # decode: its KV transfer (kvtransfer/transfer.py), from `reserve` until the KV
    # arrived or the transfer is over; kept after the record ended while pages were
    # landing (CANCELLING): its blocks wait for that write to end
    transfer: Transfer | None = None

    @property
    def claimable(self) -> bool:
        """A reader may still take its stream (`attach`)."""
        return not self.attached and (not self.state.ended or self.deadline is not None)


class RequestTable:
    """The records of one engine's requests (see the module docstring). Requests come
    in by `submit` and `reserve`; outside news by `commit`, `abort`, `abandon`,
    `release`; the engine thread's turn is `advance` (connector news, deadlines, one
    engine step). Streams are taken by `submit` (at once) or `attach` (reserved)."""

    def __init__(
        self, engine: LLMEngine, connector: KVConnector | None = None, *,
        clock: Callable[[], float] = time.monotonic, held_lease: float = 30.0, unclaimed_ttl: float = 30.0,
        max_stream_batches: int = MAX_BATCHES, metrics: WorkerMetrics | None = None,
    ) -> None:
        """`max_stream_batches`: engine steps' worth of events a request's reader may
        fall behind before the request ends (services/worker/events.py)."""
        self.engine = engine
        self.connector = connector or KVConnector.none()
        self.clock = clock
        self.held_lease = held_lease
        self.unclaimed_ttl = unclaimed_ttl
        self.max_stream_batches = max_stream_batches
        self.metrics = metrics or Disabled()
        self.num_unattached = 0  # live reservations whose Decode call has not come yet
        self._records: dict[str, Record] = {}
        self._live: Counter[State] = Counter()  # live records per state
        self._batch: dict[str, list[Event]] = {}  # this step's events, per request: a buffer, not state
        engine.token_hook = self._on_token
        if self.connector.prefill is not None:
            engine.layer_hook = self.connector.prefill.on_layer

    # -- reading ------------------------------------------------------------------------

    def get(self, request_id: str) -> Record | None:
        return self._records.get(request_id)

    def count(self, *states: State) -> int:
        """Live records in these states."""
        return sum(self._live[s] for s in states)

    def live(self) -> list[str]:
        return [r.request_id for r in self._records.values() if not r.state.ended]

    # -- requests in ------------------------------------------------------------------

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, plan: TransferPlan | None = None,
        export_kv: bool = False, first_token: int | None = None, block_hashes: Sequence[bytes] = (),
    ) -> RequestStream:
        """Run a request here; its stream. With `plan` (prefill) its KV is shipped as
        the plan says while it runs, and its blocks are held until the receiver's ack;
        `export_kv` alone holds them until `release`. `first_token`: see
        LLMEngine.add_request. `block_hashes`: the prompt's, checked by the caller
        (engine/hashing.py), reused by the engine and the connector. Raises
        ValueError (bad input, or a plan that does not fit) or TransferError (the
        plan's receiver cannot be reached): nothing stays."""
        if plan is not None and self.connector.prefill is None:
            raise ValueError("transfer_plan: this worker ships no KV (--kv-connector)")
        record = self._admit(request_id, State.QUEUED)
        try:
            if plan is not None:
                record.export = self.connector.prefill.start(request_id, prompt, plan, params.cache_salt, block_hashes)
            outputs = self.engine.add_request(request_id, prompt, params, export_kv=export_kv or plan is not None,
                                              first_token=first_token, block_hashes=block_hashes)
        except BaseException as e:
            self._end(record, Failure.ABORTED, f"refused: {e}")
            raise
        self._take(outputs)
        return record.stream

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams, lease: float,
                block_hashes: Sequence[bytes] = ()) -> tuple[Reservation, bytes]:
        """Decode side: blocks for a prompt whose KV arrives remotely, for `lease`
        seconds, and the connector's plan for its sender (b"" without a connector:
        `commit` then says when the KV is there). Its stream waits for `attach`.
        `block_hashes`: as in `submit`. Raises ValueError (bad input) or
        NoCapacityError (no room now)."""
        if request_id in self._records:
            raise ValueError(f"request_id: {request_id!r} is already running")
        reservation = self.engine.reserve_remote(request_id, prompt, params, block_hashes)
        decode = self.connector.decode
        try:
            transfer = decode.expect(reservation, prompt, params) if decode is not None else None
        except BaseException:
            self.engine.abort(request_id)
            raise
        self._admit(request_id, State.RESERVED, deadline=self.clock() + lease, attached=False, transfer=transfer)
        return reservation, transfer.plan.pack() if transfer is not None else b""

    def attach(self, request_id: str) -> RequestStream:
        """The stream of a reserved request, once. Raises KeyError if there is none."""
        record = self._records.get(request_id)
        if record is None or not record.claimable:
            raise KeyError(f"request_id: {request_id!r} has no reservation to stream")
        record.attached = True
        if not record.state.ended:
            self.num_unattached -= 1
        self._settle(record)
        return record.stream

    def commit(self, request_id: str, first_token: int | None) -> None:
        """The reserved blocks hold the prompt's KV (for a table without a connector;
        with one, its arrivals commit): decode, from `first_token` if given."""
        record = self._records.get(request_id)
        if record is None or record.state not in AWAITING_KV or record.transfer is not None:
            log.warning("commit for %r, which has no reservation waiting for it (expired, aborted or "
                        "expected by the connector)", request_id)
            return
        self._commit(record, first_token)

    def abort(self, request_id: str, failure: Failure = Failure.ABORTED, message: str = "aborted") -> None:
        """Stop a request wherever it is and free its blocks (idempotent)."""
        record = self._records.get(request_id)
        if record is not None and not record.state.ended:
            self._end(record, failure, message)

    def abandon(self, request_id: str) -> None:
        """A reservation whose KV will not come (its sender is gone): fail it as a lost
        transfer if it still waits for it; a request whose KV arrived goes on."""
        record = self._records.get(request_id)
        if record is not None and record.state in AWAITING_KV:
            self._end(record, Failure.TRANSFER, "the KV's sender is gone")

    def release(self, request_id: str) -> None:
        """Prefill side: the exported KV has been shipped; free the held blocks."""
        record = self._records.get(request_id)
        if record is not None and record.state is State.HELD:
            self._end(record, None)

    def close(self) -> None:
        """Fail every live request with SHUTDOWN and free it."""
        for request_id in self.live():
            self.abort(request_id, Failure.SHUTDOWN, "worker is shutting down")

    # -- the engine thread's turn ---------------------------------------------------------

    def advance(self) -> list[RequestOutput]:
        """What one iteration of the engine thread does: take the connector's news,
        enforce deadlines, step the engine if it has work; the step's outputs."""
        try:
            self.poll()
        except Exception:  # a transport's bug must not stop deadlines or the engine
            log.exception("KV connector poll failed")
        self.expire()
        return self.step() if self.engine.has_scheduled_work() else []

    def poll(self) -> None:
        """The connector's news: pages landing, KV arrived or lost, acks."""
        decode, prefill = self.connector.decode, self.connector.prefill
        if decode is not None:
            self._on_decode(decode.poll())
        if prefill is not None:
            update = prefill.poll()
            self.metrics.kv_sent(update.done.values())
            for request_id in update.done:
                record = self._records.get(request_id)
                if record is not None and record.state is State.HELD:
                    record.export = None  # acknowledged: the connector is done with it
                    self._end(record, None)
            for request_id, why in update.failed.items():
                record = self._records.get(request_id)
                if record is not None and not record.state.ended:
                    record.export = None  # over: the connector has told the receiver
                    self._end(record, Failure.TRANSFER, f"KV transfer: {why}")

    def expire(self) -> None:
        """End what is past its deadline."""
        now = self.clock()
        for record in [r for r in self._records.values() if r.deadline is not None and now >= r.deadline]:
            if record.state in AWAITING_KV:
                log.warning("reservation %r expired before its KV arrived", record.request_id)
                self.metrics.reservation_expired()
                self._end(record, Failure.EXPIRED, "reservation expired: its deadline passed before its KV arrived")
            elif record.state is State.HELD:
                log.warning("lease on the exported KV of %r ran out: releasing", record.request_id)
                self._end(record, Failure.TRANSFER, "lease on the exported KV ran out")
            else:  # ended, never attached: its stream waited long enough
                record.deadline = None
                self._settle(record)

    def step(self) -> list[RequestOutput]:
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
            return []
        self.metrics.step(time.perf_counter() - start, self.engine.last_batch)
        for request_id in self.engine.last_scheduled:
            record = self._records.get(request_id)
            if record is not None and record.state is State.QUEUED:
                self._move(record, State.RUNNING)
        self._take(outputs)
        return outputs

    def flush(self) -> None:
        """Hand each stream this step's events in one batch. A stream whose reader is
        too far behind (its client stopped reading) ends here, its blocks freed."""
        behind = [rid for rid in list(self._batch) if not self._flush_one(rid)]
        for request_id in behind:
            log.warning("request %s: its reader is %d engine steps behind: ending it", request_id,
                        self.max_stream_batches)
            self.abort(request_id, Failure.ABORTED, "the client stopped reading the stream")

    # -- the one move, the one way out -----------------------------------------------------

    def _move(self, record: Record, state: State, deadline: float | None = None) -> None:
        """Change a record's state (and deadline: the new state's)."""
        if state not in MOVES[record.state]:
            raise IllegalTransition(f"request {record.request_id!r}: no move from {record.state.name} to {state.name}")
        self._live[record.state] -= 1
        if state.ended:
            if not record.attached:
                self.num_unattached -= 1
        else:
            self._live[state] += 1
        log.debug("request %s: %s -> %s", record.request_id, record.state.name, state.name)
        record.state = state
        record.deadline = deadline

    def _end(self, record: Record, failure: Failure | None, message: str = "") -> None:
        """End a record: FINISHED (failure None: its stream has had its last event) or
        FAILED (its stream told why, after the tokens told so far); then `_free`."""
        self._move(record, State.FINISHED if failure is None else State.FAILED,
                   None if record.attached else self.clock() + self.unclaimed_ttl)
        self._flush_one(record.request_id)  # what was told so far goes first
        if not record.closed:  # (a FINISHED record's stream has had its last event)
            record.stream.put(FailedEvent(failure or Failure.INTERNAL, message), final=True)
            record.closed = True
        self._free(record, message or record.state.value)

    def _free(self, record: Record, why: str) -> None:
        """The one place an ended record lets go of what it holds, on every way out:
        the connector stops first (a prefill worker's sender tells its receiver; a
        decode worker's receiver forgets the reservation), then the engine frees the
        blocks (`engine.abort` frees running, waiting, reserved and held blocks alike).
        When pages are landing in a reservation's blocks, the record keeps its transfer
        and the blocks; `_on_decode` calls this again once the connector reports that
        write over."""
        if record.export is not None:
            export, record.export = record.export, None
            self.connector.prefill.cancel(export, why)
        transfer = record.transfer
        if transfer is not None and not self.connector.decode.cancel(transfer, why):
            return  # CANCELLING: freed when the write ends
        record.transfer = None
        self.engine.abort(record.request_id)
        self._settle(record)

    def _settle(self, record: Record) -> None:
        """Forget an ended record nothing waits for any more."""
        if record.state.ended and record.transfer is None and not record.claimable:
            del self._records[record.request_id]

    # -- internals --------------------------------------------------------------------------

    def _admit(self, request_id: str, state: State, **fields) -> Record:
        if request_id in self._records:
            raise ValueError(f"request_id: {request_id!r} is already running")
        record = Record(request_id, RequestStream(request_id, self.max_stream_batches), state, **fields)
        self._records[request_id] = record
        self._live[state] += 1
        if not record.attached:
            self.num_unattached += 1
        return record

    def _on_decode(self, update) -> None:
        for request_id in update.receiving:
            record = self._records.get(request_id)
            if record is not None and record.state is State.RESERVED:
                self._move(record, State.RECEIVING, record.deadline)
        for request_id, first_token in update.arrived.items():
            record = self._records.get(request_id)
            if record is not None and record.transfer is not None and record.state in AWAITING_KV:
                record.transfer = None  # arrived: nothing is left to stop
                self._commit(record, first_token, update.drafts.get(request_id))
        for request_id, why in update.failed.items():
            record = self._records.get(request_id)
            if record is None or record.transfer is None:
                continue
            record.transfer = None  # over: nothing writes its blocks any more
            if record.state.ended:  # the write that kept its blocks is over: free them
                self._free(record, why)
            elif record.state in AWAITING_KV:
                self._end(record, Failure.TRANSFER, f"KV transfer: {why}")

    def _commit(self, record: Record, first_token: int | None, draft: DraftState | None = None) -> None:
        self._move(record, State.QUEUED)
        try:
            outputs = self.engine.commit_remote(record.request_id, first_token, draft)
        except Exception as e:
            self._end(record, Failure.INTERNAL, f"commit: {e}")
            return
        self._take(outputs)

    def _take(self, outputs: list[RequestOutput]) -> None:
        """The engine's outputs of finished requests, then every event told so far."""
        for output in outputs:
            self._finished(output)
        self.flush()

    def _finished(self, output: RequestOutput) -> None:
        """The engine is done with a request: FINISHED, HELD (its KV is being shipped),
        or FAILED (the engine failed it alone: its tokens so far, then why)."""
        self.metrics.request_finished(output.times)
        record = self._records.get(output.request_id)
        if record is None or record.state.ended:
            return
        if output.error is not None:
            self._end(record, output.failure or Failure.INTERNAL, output.error)
            return
        if output.request_id in self.engine.held:
            if record.export is not None:
                try:
                    self.connector.prefill.finish(output.request_id, _first_token(output),
                                                  self.engine.held_draft(output.request_id))
                except TransferError as e:
                    record.export = None  # the connector has told the receiver
                    self._end(record, Failure.TRANSFER, f"KV transfer of {output.request_id!r} failed: {e}")
                    return
            self._emit(record, FinishedEvent(output))
            self._move(record, State.HELD, self.clock() + self.held_lease)
            return
        self._emit(record, FinishedEvent(output))
        self._end(record, None)  # an export that ended without KV ("abort": can never fit): the receiver is told

    def _on_token(self, delta: TokenDelta) -> None:
        record = self._records.get(delta.request_id)
        if record is not None and not record.closed:
            self._emit(record, TokenEvent(delta))

    def _emit(self, record: Record, event: Event) -> None:
        self._batch.setdefault(record.request_id, []).append(event)
        if isinstance(event, (FinishedEvent, FailedEvent)):
            record.closed = True

    def _flush_one(self, request_id: str) -> bool:
        """Put a request's pending events; False when its reader is too far behind."""
        events = self._batch.pop(request_id, None)
        record = self._records.get(request_id)
        if not events or record is None:
            return True
        return record.stream.put(*events, final=isinstance(events[-1], (FinishedEvent, FailedEvent)))

    def _step_failed(self, error: Exception) -> None:
        # The batch, or (failed before it was known) every request the scheduler holds;
        # reservations waiting for their KV are in no batch and stay.
        suspects = list(self.engine.last_scheduled) or [
            rid for rid in self.engine.groups if (r := self._records.get(rid)) is None or r.state not in AWAITING_KV]
        try:
            self.engine.check_integrity()
        except Exception:
            log.exception("engine state inconsistent after a failed step: failing every request")
            suspects = self.live()
        log.error("engine step failed (%s: %s): failing requests %s", type(error).__name__, error, suspects,
                  exc_info=error)
        for request_id in suspects:
            self.abort(request_id, Failure.INTERNAL, f"engine: {type(error).__name__}: {error}")


def _first_token(output: RequestOutput) -> int | None:
    completion = output.outputs[0] if output.outputs else None
    return completion.token_ids[0] if completion is not None and completion.token_ids else None

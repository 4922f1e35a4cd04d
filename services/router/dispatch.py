"""Running one validated request on the workers: the composition, and the P/D seam.

    Dispatcher.run(job)
      _serve: attempts on decode workers (attempts.py), each one `_on` below
        every update on its way to the client:
          continued after a migration: rebase (migration.py)
          continued, with stop strings: StopWatch.cut (stops.py); a cut ends it
          Progress.record (what the client has)
        Broken (D failed after something reached the client):
          the final update went out: served
          every sequence had ended: the final update, made here
          else migrate (at most --max-migrations, within the deadline; else
          UNAVAILABLE saying why): n == 1, `_serve` again from prompt + tokens sent;
          n > 1, each unfinished sample as a request of its own (fan_out.py)

    _on(D), one attempt (the P/D seam):
        if D and some prefill worker can move KV and the prompt's part D has not
           cached is >= --local-prefill-threshold tokens:
            D.Reserve -> blocks + KV endpoint
            D.Decode(local_prefill=false) -> D's token stream (buffered on D)
            P = best prefill worker (cached prefix vs queue); P.Prefill(D's endpoint)
              -> first token, forwarded at once (TTFT)
              P failed: abort that reservation, next P with a fresh one
              D has no room to reserve now: prefill on D (its scheduler queues it)
            stream D's updates: D streams the tokens it samples after P's first
              (services/decode/stream.py), forwarded as they are; on the final one
              sequence 0's cumulative logprob also counts P's first token
              D's KV never came (transfer failed, reservation expired): D prefills
              the prompt itself, continuing from the first token already sent
            no P left: abort the reservation, prefill on D instead
            D or P hashes the prompt otherwise (FailureKind BLOCK_HASH_MISMATCH: another
              tokenizer, block size or salt): the request fails (INTERNAL, naming
              the cause), never falling back: every prompt would mismatch there
            D or P refuses the request's structured-outputs constraint (FailureKind
              INVALID_CONSTRAINT: INVALID_ARGUMENT; CONSTRAINT_TIMEOUT: DEADLINE_EXCEEDED):
              the request fails with that status, never retried, migrated or
              prefilled elsewhere (every worker runs the same backend and limits)
        elif the prompt should cross but no P can take it (none, draining, all at
           --max-prefill-queue): prefill on D (counted by reason)
        else:
            D.Decode(local_prefill=true) -> D's token stream
    Every Reserve, Prefill and prompt-carrying Decode carries the job's block hashes
    (a continuation's: its own prompt's), which each worker checks once and reuses.
    Caller gone (its Cancellation fired) or deadline: Abort on the workers.

Every worker message becomes a router event (events.py) where it arrives, in
`_stream`; nothing here edits a protobuf message. Errors are the project's
(ServeError with a Status); gRPC errors of worker calls are classified here, where
the workers are called (failures.py names the kinds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from functools import partial

import grpc

from pdserve.engine.detokenizer import Decoder
from pdserve.engine.errors import FailureKind
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import status_of_rpc
from pdserve.services.common.failure import failure_of, wire_name
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router import policy, worker_limits
from pdserve.services.router.attempts import Attempt, Attempts, Broken, Path
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.events import Update, first_of, update_of
from pdserve.services.router.failures import GONE, KVLost, WorkerFailed
from pdserve.services.router.fan_out import fan_out
from pdserve.services.router.migration import Progress, continuation, rebase, resumed_progress, unmigratable
from pdserve.services.router.registry import WorkerHandle, WorkerRegistry
from pdserve.services.router.stops import stop_watch
from pdserve.services.router.validate import Job

log = logging.getLogger(__name__)
ABORT_TIMEOUT = 1.0
# A request's constraint refused by a worker: its own final failure (`_constraint_failed`).
CONSTRAINT_FAILURES = (FailureKind.INVALID_CONSTRAINT, FailureKind.CONSTRAINT_TIMEOUT)
RESERVE_TIMEOUT = 10.0
RESERVATION_LEASE = 30.0


class Dispatcher:
    def __init__(
        self, registry: WorkerRegistry, config: RouterConfig, metrics: RouterMetrics, tokenizer: Decoder | None = None,
    ) -> None:
        """`tokenizer`: to match stop strings across a migration (none: no stop strings)."""
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.tokenizer = tokenizer

    def run(
        self, job: Job, deadline: Deadline, cancel: Cancellation, note_cached: Callable[[int], None]
    ) -> Iterator[Update]:
        """Serve `job` on a decode worker, trying another one (at most --max-attempts)
        while no token has reached the client. When none (left) is serving, wait up to
        --admission-timeout (within the deadline) for one to join: a restarted decode
        worker is a pause, not a burst of UNAVAILABLE.

        Every worker call is registered with `cancel` (cancelled when the caller goes
        or the request ends). Raises ServeError; CANCELLED once `cancel` fired.

        A resume (`job.resumed`, resume.py) is served as a stream that migrated after
        the tokens the client has: each sequence continues from its own (n > 1: one
        request each, fan_out.py), and one that had ended is not run again."""
        progress = resumed_progress(job)
        if progress is None:
            yield from self._serve(job, Progress(n=job.params.n), deadline, cancel, note_cached, [])
        elif progress.done:  # only the final message was lost
            yield progress.final_message()
        elif job.params.n > 1:
            yield from self._fan_out(job, progress, deadline, cancel, note_cached, [])
        else:
            yield from self._serve(job, progress, deadline, cancel, note_cached, [])

    def _serve(
        self, job: Job, progress: Progress, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None], tried: list[WorkerHandle],
    ) -> Iterator[Update]:
        """`run`, from `progress` (with migrations: what reached the client of a
        continued sample before this serve began), on decode workers not in `tried`."""
        while True:
            try:
                yield from self._follow(job, progress, deadline, cancel, note_cached, tried)
                return
            except Broken as e:
                if progress.finished:  # the final update went out; only the stream's close was lost
                    log.info("request %s: %s after its final message; served", job.request_id, e)
                    return
                if progress.sent and progress.done and unmigratable(job) is None:  # only the final update was lost
                    yield progress.final_message()
                    return
                self._migrate(job, progress, e.decode, e.error, deadline)
            if job.params.n > 1:  # its sequences go on as requests of their own
                yield from self._fan_out(job, progress, deadline, cancel, note_cached, tried)
                return

    def _fan_out(
        self, job: Job, progress: Progress, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None], tried: list[WorkerHandle],
    ) -> Iterator[Update]:
        """Each sequence of `job` that has not ended, continued as a request of its own
        (fan_out.py), each one served as `_serve` serves, avoiding `tried`."""
        yield from fan_out(job, progress, deadline, cancel, lambda one, sample, inner: self._serve(
            one, sample, deadline, inner, note_cached, list(tried)))

    def _follow(
        self, job: Job, progress: Progress, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None], tried: list[WorkerHandle],
    ) -> Iterator[Update]:
        """`job` (after a migration: its continuation) through the attempts, each
        update recorded in `progress` on its way to the client (the module docstring)."""
        current, cached = job, note_cached
        if progress.migrations:
            current = continuation(job, progress.token_ids, self.config.block_size)
            cached = partial(_cached_of_prompt, note_cached, len(job.prompt))
        stops = stop_watch(self.tokenizer, job, progress.token_ids, migrated=bool(progress.migrations))
        after = f"; after {progress.sent} tokens and {progress.migrations} migrations" if progress.migrations else ""
        attempts = Attempts(self.registry, self.config, self.metrics)  # (the config as of now: tests change it)
        serve = partial(self._on, deadline=deadline, cancel=cancel, note_cached=cached)
        with closing(attempts.run(current, serve, deadline, cancel, tried, after)) as updates:
            for update in updates:
                if progress.migrations:
                    update = rebase(update, job, progress)
                cut = stops.cut(update) if stops is not None else None
                progress.record(cut or update, job.params.max_tokens)
                yield cut or update
                if cut is not None:  # a stop string spanning the migration ended it
                    yield progress.final_message()
                    return

    def _migrate(
        self, job: Job, progress: Progress, decode: WorkerHandle, error: WorkerFailed, deadline: Deadline
    ) -> None:
        """Count a migration of `job` after its decode worker failed mid-stream
        (migration.py), by reason; raises UNAVAILABLE, naming why, when it cannot or
        may not migrate (--max-migrations)."""
        failed = f"decode worker {decode.worker_id} failed mid-stream after {progress.sent} tokens: {error}"
        why = unmigratable(job)
        if why is None and progress.migrations >= self.config.max_migrations:
            why = f"--max-migrations {self.config.max_migrations} reached"
        if why is None and deadline.remaining() <= 0:
            why = "the deadline passed"
        if why is not None:
            log.warning("request %s: %s; failing it (not migrated: %s)", job.request_id, failed, why)
            raise ServeError(Status.UNAVAILABLE, f"{failed}; not migrated: {why}") from None
        progress.migrated()
        self.metrics.migration("dropped" if decode.dropped else "stream_broken")
        log.warning("request %s: %s; migrating it (%d of at most %d)", job.request_id, failed,
                    progress.migrations, self.config.max_migrations)

    def _on(
        self, decode: WorkerHandle, job: Job, attempt: Attempt, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None],
    ) -> Iterator[Update]:
        """One attempt on `decode` (the module docstring's `_on`)."""
        worker_limits.check(job.params, decode.info)  # what D registered, before D is asked anything
        if self._wants_remote_prefill(job, decode):
            why = self.registry.no_remote_prefill()
            if why is None:
                why = yield from self._disaggregated(decode, job, attempt, deadline, cancel, note_cached)
                if why is None:
                    return
            attempt.path = Path.FALLBACK
            self.metrics.local_prefill_fallback(why)
            log.info("request %s: prefilling on decode worker %s (%s)", job.request_id, decode.worker_id, why)
        self.metrics.prefill_path(attempt.path.value)
        yield from self._local(decode, job, attempt, deadline, cancel)

    def _local(
        self, decode: WorkerHandle, job: Job, attempt: Attempt, deadline: Deadline, cancel: Cancellation,
        first: pb.TokenLogprob | None = None,
    ) -> Iterator[Update]:
        """D prefills the prompt itself; with `first` (P's first token, which the
        client has), continuing from it instead of sampling another."""
        request = pb.DecodeRequest(
            request_id=attempt.worker_request_id, local_prefill=True, token_ids=job.prompt, sampling=job.options,
            cache_salt=job.cache_salt, first_token=first.token_id if first is not None else None,
            block_hashes=job.block_hashes,
        )
        call = decode.stub.Decode(request, timeout=deadline.remaining())
        yield from self._stream(decode, call, attempt, cancel, first)

    def _wants_remote_prefill(self, job: Job, decode: WorkerHandle) -> bool:
        """Whether the prompt should cross from a prefill worker (whether one can is
        asked next): D takes KV, and the part of the prompt D lacks is long enough."""
        if not decode.info.kv_endpoint or job.params.prompt_logprobs is not None:
            return False
        # D's reservation counts the blocks in any of its tiers as present
        cached = policy.cached_prefix_tokens(job.block_hashes, decode.cached, self.config.block_size,
                                             *decode.cached_lower)
        return not policy.prefill_locally(len(job.prompt), cached, self.config.local_prefill_threshold)

    # -- the P/D seam ---------------------------------------------------------------------

    def _disaggregated(
        self, decode: WorkerHandle, job: Job, attempt: Attempt, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None],
    ) -> Generator[Update, None, str | None]:
        """Reserve on D, prefill on P into D's blocks, stream D. Returns None when
        served, else why the request should be prefilled on D after all (nothing was
        sent): "prefill_failed" (every prefill worker tried failed), "no_reservation"
        (D cannot take KV), "kv_transfer" (the KV never came, and P sampled no first
        token), or what `no_remote_prefill` says.

        A prefill worker that fails gets no second chance with the same reservation:
        it may have shipped part of the KV, and pages of a dead transfer must never mix
        with the next one's. So each prefill try has a reservation (and worker
        request id) of its own, and the failed one is aborted on D."""
        tried = {decode.worker_id}
        attempt.path = Path.REMOTE
        for number in range(self.config.max_attempts):
            prefill = self.registry.acquire_prefill(job.block_hashes, tried)
            if prefill is None:  # none (left): prefill on D
                return "prefill_failed" if number else (self.registry.no_remote_prefill() or "queue_full")
            self.metrics.worker_chosen(prefill.worker_id, prefill.role)
            tried.add(prefill.worker_id)
            attempt.prefill_try = number
            rid = attempt.worker_request_id
            try:
                reservation = self._reserve(decode, job, rid, deadline, cancel)
                if reservation is None:
                    return "no_reservation"
                call = decode.stub.Decode(pb.DecodeRequest(request_id=rid), timeout=deadline.remaining())
                cancel.add_callback(call.cancel)
                prefilled = self._prefill(prefill, decode, job, rid, reservation, deadline, cancel)
            finally:
                self.registry.release(prefill)
            if prefilled is None:  # that prefill worker failed: free D's reservation, next one
                call.cancel()
                _abort_quietly(decode, rid)
                self.metrics.retry("prefill")
                continue
            self.metrics.prefill_path(Path.REMOTE.value)
            note_cached(max(prefilled.num_cached_tokens, reservation.num_cached_tokens))
            first = prefilled.first_token if prefilled.HasField("first_token") else None
            if first is not None:
                attempt.produced = True
                yield first_of(first, with_logprobs=job.params.logprobs is not None)
            # A prefill worker that dies now may have left its last frames unsent: D
            # would wait out the reservation. Abort it instead (if D has sent nothing).
            unwatch = self.registry.watch(prefill, lambda: self._abandon(decode, rid, attempt))
            try:
                yield from self._stream(decode, call, attempt, cancel, first)
            except KVLost as e:
                attempt.kv_abandoned = False  # what follows is a stream of its own
                if first is None:  # nothing reached the client: prefill on D as usual
                    return "kv_transfer"
                yield from self._kv_fallback(decode, job, attempt, deadline, cancel, first, str(e))
            finally:
                unwatch()
            return None
        return "prefill_failed"

    @staticmethod
    def _abandon(decode: WorkerHandle, rid: str, attempt: Attempt) -> None:
        """The prefill worker of `rid` is gone: if D has not started decoding it, abort
        the reservation (its KV may never complete); the stream then falls back."""
        if attempt.decoded or attempt.worker_request_id != rid:
            return
        log.warning("request %s: its prefill worker was dropped before %s decoded; aborting the reservation",
                    rid, decode.worker_id)
        attempt.kv_abandoned = True
        _abort_quietly(decode, rid, only_reserved=True)  # a race with D's commit must not kill a decoding request

    def _kv_fallback(
        self, decode: WorkerHandle, job: Job, attempt: Attempt, deadline: Deadline, cancel: Cancellation,
        first: pb.TokenLogprob, why: str,
    ) -> Iterator[Update]:
        """The KV never reached D, but the client has the prefill worker's first token:
        D prefills the prompt itself, continuing from that token (not sampling another),
        so the client sees one slower token, not an error."""
        log.warning("request %s: KV transfer to %s failed after the first token (%s); prefilling it there",
                    job.request_id, decode.worker_id, why)
        self.metrics.local_prefill_fallback("kv_transfer")
        attempt.path = Path.KV_LOST
        yield from self._local(decode, job, attempt, deadline, cancel, first)

    def _reserve(
        self, decode: WorkerHandle, job: Job, rid: str, deadline: Deadline, cancel: Cancellation
    ) -> pb.ReserveResponse | None:
        request = pb.ReserveRequest(
            request_id=rid, token_ids=job.prompt, sampling=job.options,
            timeout_seconds=min(deadline.remaining(), RESERVATION_LEASE), cache_salt=job.cache_salt,
            block_hashes=job.block_hashes,
        )
        try:
            return decode.stub.Reserve(request, timeout=min(deadline.remaining(), RESERVE_TIMEOUT))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and failure_of(e) is not FailureKind.BLOCK_HASH_MISMATCH:
                # No KV receiver after all: D can still prefill. (Hashes that differ fail the request: _classify.)
                log.warning("request %s: %s cannot reserve (%s); prefilling there", job.request_id, decode.worker_id,
                            e.details())
                return None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not cancel.cancelled:
                # No room in D's cache right now: a reservation cannot wait, but D's
                # scheduler can, so prefill there (queued until running requests free blocks).
                log.info("request %s: no room to reserve on %s (%s); prefilling there", job.request_id,
                         decode.worker_id, e.details())
                return None
            raise self._classify(decode, e, cancel, rid) from None

    def _prefill(
        self, prefill: WorkerHandle, decode: WorkerHandle, job: Job, rid: str, reservation: pb.ReserveResponse,
        deadline: Deadline, cancel: Cancellation,
    ) -> pb.PrefillResponse | None:
        """Prefill on `prefill` into D's reservation; None when it failed as a worker may
        (another one may do better)."""
        request = prefill_request(job, rid, reservation)
        try:
            future = prefill.stub.Prefill.future(request, timeout=deadline.remaining())
            cancel.add_callback(future.cancel)
            return future.result()
        except grpc.FutureCancelledError:  # by `cancel`: the caller is gone
            _abort_quietly(prefill, rid)
            _abort_quietly(decode, rid)
            raise ServeError(Status.CANCELLED, GONE) from None
        except ValueError:  # "Channel closed": the registry dropped it just now
            if not prefill.dropped:
                raise
            log.warning("request %s: prefill worker %s was dropped; next prefill worker", job.request_id,
                        prefill.worker_id)
            return None
        except grpc.RpcError as e:
            error = self._classify(prefill, e, cancel, rid)
            if not isinstance(error, WorkerFailed):
                _abort_quietly(decode, rid)
                raise error from None
            log.warning("request %s: prefill on %s failed (%s); next prefill worker",
                        job.request_id, prefill.worker_id, error)
            self.registry.probe_soon()
            return None

    # -- streams and errors -----------------------------------------------------------------

    def _stream(
        self, worker: WorkerHandle, call: grpc.Call, attempt: Attempt, cancel: Cancellation,
        first: pb.TokenLogprob | None,
    ) -> Iterator[Update]:
        """D's messages as updates, forwarded as they are. With `first`, sequence 0's
        first token came from the prefill worker and reached the client already: D
        streams only the tokens it samples after it and counts only their logprobs,
        so the final update's cumulative logprob also counts the first token's."""
        cancel.add_callback(call.cancel)
        given = {0: first.logprob} if first is not None else {}
        try:
            for message in call:
                update = update_of(message).counting(given)
                if update.has_tokens:
                    attempt.produced = attempt.decoded = True
                yield update
        except grpc.RpcError as e:
            abandoned = attempt.kv_abandoned and failure_of(e) not in CONSTRAINT_FAILURES  # those are final
            if not attempt.decoded and not cancel.cancelled and (_kv_lost(e) or abandoned):
                raise KVLost(e.details() or "") from None
            raise self._classify(worker, e, cancel, attempt.worker_request_id) from None

    def _classify(self, worker: WorkerHandle, error: grpc.RpcError, cancel: Cancellation, rid: str) -> Exception:
        """A worker call's gRPC error as ours: the caller gone (CANCELLED), a deadline
        passed, a worker failure another worker may not have (WorkerFailed), or the
        worker's own status passed on. The details name the worker's FailureKind
        when it told one (services/common/failure.py). A worker that hashes prompts
        otherwise (BLOCK_HASH_MISMATCH) fails the request as INTERNAL, naming the
        causes: the cluster is misconfigured, not the request wrong."""
        code = error.code()
        kind = failure_of(error)
        details = error.details() or ""
        if kind is not None:
            details = f"{details} [{wire_name(kind)}]".lstrip()
        if cancel.cancelled:
            _abort_quietly(worker, rid)
            return ServeError(Status.CANCELLED, GONE)
        if kind in CONSTRAINT_FAILURES:
            return self._constraint_failed(worker, kind, details, rid)
        if kind is FailureKind.BLOCK_HASH_MISMATCH:
            log.error("worker %s hashes prompts otherwise than this router: %s", worker.worker_id, details)
            return ServeError(Status.INTERNAL, f"worker {worker.worker_id} and the router hash the prompt's blocks "
                              f"differently: they differ in tokenizer, block size or cache salt ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            _abort_quietly(worker, rid)
            return ServeError(Status.DEADLINE_EXCEEDED, f"deadline passed ({error.details()})")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED):
            why = "dropped" if worker.dropped else f"{code.name}: {details}"
            return WorkerFailed(f"worker {worker.worker_id} {why}", busy=code == grpc.StatusCode.RESOURCE_EXHAUSTED)
        return ServeError(status_of_rpc(code), details or code.name)

    def _constraint_failed(self, worker: WorkerHandle, kind: FailureKind, details: str, rid: str) -> ServeError:
        """The request's constraint failed on a worker: its own fault, final. Another
        worker would refuse it alike (one backend and limits for the cluster), so it is
        never retried, migrated or prefilled elsewhere: INVALID_ARGUMENT when the backend
        refused it, DEADLINE_EXCEEDED when it did not compile in time. The message names
        `structured_outputs` (the HTTP API renames it to the caller's field)."""
        invalid = kind is FailureKind.INVALID_CONSTRAINT
        self.metrics.structured_refusal("invalid" if invalid else "timeout")
        if invalid:
            return ServeError(Status.INVALID_ARGUMENT, f"structured_outputs: refused by the grammar backend of "
                              f"worker {worker.worker_id}: {details}")
        _abort_quietly(worker, rid)
        return ServeError(Status.DEADLINE_EXCEEDED, f"structured_outputs: did not compile within the workers' "
                          f"--structured-outputs-compile-timeout on worker {worker.worker_id}: {details}")


def prefill_request(job: Job, rid: str, reservation: pb.ReserveResponse) -> pb.PrefillRequest:
    """What the prefill worker is asked: the prompt, and where and how its KV goes
    (the decode worker's transfer plan, carried unread)."""
    return pb.PrefillRequest(
        request_id=rid, token_ids=job.prompt, sampling=job.options, cache_salt=job.cache_salt,
        transfer_plan=reservation.transfer_plan, block_hashes=job.block_hashes,
    )


def _cached_of_prompt(note_cached: Callable[[int], None], prompt_len: int, n: int) -> None:
    """A continuation's cached tokens, counted within the original prompt (its own
    prompt holds the tokens sent too)."""
    note_cached(min(n, prompt_len))


def _kv_lost(error: grpc.RpcError) -> bool:
    """Whether a decode stream failed because its KV never arrived (not D's fault)."""
    kind = failure_of(error)
    return kind is not None and kind.kv_lost


def _abort_quietly(worker: WorkerHandle, rid: str, only_reserved: bool = False) -> None:
    """Best effort: the worker also aborts on its own when our stream to it ends."""
    try:
        worker.stub.Abort(pb.AbortRequest(request_id=rid, only_reserved=only_reserved), timeout=ABORT_TIMEOUT)
    except grpc.RpcError:
        pass

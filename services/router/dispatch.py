"""Running one validated request on the workers, with retries.

    for each attempt (another decode worker each time, at most --max-attempts):
        D = least loaded decode worker (none left: wait up to --admission-timeout
            for one to join or rejoin)
        if D and some prefill worker can move KV and the prompt's part D has not
           cached is >= --local-prefill-threshold tokens:         # P/D seam
            D.Reserve -> blocks + KV endpoint
            D.Decode(local_prefill=false) -> D's token stream (buffered on D)
            P = best prefill worker (cached prefix vs queue); P.Prefill(D's endpoint)
              -> first token, forwarded at once (TTFT)
              P failed: abort that reservation, next P with a fresh one
              D has no room to reserve now: prefill on D (its scheduler queues it)
            stream D's tokens after the first
              D's KV never came (transfer failed, reservation expired): D prefills
              the prompt itself, continuing from the first token already sent
            no P left: abort the reservation, prefill on D instead
        elif the prompt should cross but no P can take it (none, draining, all at
           --max-prefill-queue): prefill on D (counted by reason)
        else:
            D.Decode(local_prefill=true) -> D's token stream
    A worker failure before any token reached the client: next attempt.
    After a token: migrate (migration.py): the same loop, with the prompt plus the
    tokens sent, at most --max-migrations times; else UNAVAILABLE saying why.
    Caller gone (its Cancellation fired) or deadline: Abort on the workers.

Each try is an `Attempt` record: decode attempt number, prefill try, path. The
worker request id is derived from it in one place (`Attempt.worker_request_id`),
distinct for every decode attempt, prefill try and path, so a late abort of one
try can never hit the next:

    <job>-<attempt>              local prefill, or the first prefill try (remote)
    <job>-<attempt>-p<try>       the try-th prefill worker, with a reservation of its own
    ...-local                    D prefills after all (no P could take it, P failed, or the
                                 KV never came before a token)
    ...-kv                       D prefills after the KV was lost past the first token

Errors are the project's (ServeError with a Status); gRPC errors of worker calls
are classified here, where the workers are called.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace

import grpc

from pdserve.engine.detokenizer import Decoder
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import status_of_rpc
from pdserve.services.common.failure import failure_of, wire_name
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router import policy, worker_limits
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.migration import Progress, StopWatch, continuation, one_sample, rebase, unmigratable
from pdserve.services.router.registry import WorkerHandle, WorkerRegistry
from pdserve.services.router.validate import Job

log = logging.getLogger(__name__)
ABORT_TIMEOUT = 1.0
RESERVE_TIMEOUT = 10.0
RESERVATION_LEASE = 30.0
FAN_OUT_SLACK = 5.0  # seconds past the deadline a migrated sample's thread has to say how it ended
GONE = "the caller went away"  # the message of a request whose caller left (nobody reads it)


class WorkerFailed(Exception):
    """A worker died or refused in a way another worker may not. `busy`: it refused
    for want of capacity (RESOURCE_EXHAUSTED), so it is there but full."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class KVLost(Exception):
    """D's reservation failed before any token of D's own: the KV transfer failed or
    its reservation expired (D's trailing metadata names a FailureKind whose
    `kv_lost` holds: TRANSFER or EXPIRED). D is fine."""


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
    number: int  # the decode attempt: 0, 1, ... < --max-attempts
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
    ) -> Iterator[pb.DecodeResponse]:
        """Serve `job` on a decode worker, trying another one (at most --max-attempts)
        while no token has reached the client. When none (left) is serving, wait up to
        --admission-timeout (within the deadline) for one to join: a restarted decode
        worker is a pause, not a burst of UNAVAILABLE.

        Every worker call is registered with `cancel` (cancelled when the caller goes
        or the request ends). Raises ServeError; CANCELLED once `cancel` fired."""
        yield from self._serve(job, Progress(n=job.params.n), deadline, cancel, note_cached)

    def _serve(
        self, job: Job, progress: Progress, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None], failed: tuple[WorkerHandle, ...] = (),
    ) -> Iterator[pb.DecodeResponse]:
        """`run`, from `progress`: with migrations, what reached the client of a
        continued sample (n == 1) before this serve began, on a worker not `failed`."""
        tried: list[WorkerHandle] = list(failed)  # every decode worker tried (never asked again)
        attempts = 0  # of the current run (the request, or its latest continuation)
        failures: list[str] = []
        busy = 0  # attempts refused for want of capacity
        current = job if not progress.migrations else continuation(job, progress.token_ids, self.config.block_size)
        stops = self._stop_watch(job, progress)  # after a migration, with stop strings
        fan_out = False
        admission = Deadline.after(min(self.config.admission_timeout, deadline.remaining()))
        while attempts < self.config.max_attempts:
            decode = self.registry.acquire_decode(current.block_hashes, tried)
            if decode is None:
                if self.registry.wait_for_decode(tried, admission.remaining()) and not cancel.cancelled:
                    continue
                break
            self.metrics.worker_chosen(decode.worker_id, decode.role)
            attempt = Attempt(job.worker_request_id, len(tried))
            tried.append(decode)
            attempts += 1
            try:
                try:
                    cached = note_cached if current is job else lambda n: note_cached(min(n, len(job.prompt)))
                    for message in self._on(decode, current, attempt, deadline, cancel, cached):
                        if progress.migrations:
                            rebase(message, job, progress)
                        cut = stops is not None and stops.cut(message)
                        progress.record(message, job.params.max_tokens)
                        yield message
                        if cut:  # a stop string spanning the migration ended it
                            yield progress.final_message()
                            return
                    return
                except ValueError as e:  # "Channel closed": the registry dropped it just now
                    if not decode.dropped:
                        raise
                    raise WorkerFailed(f"worker {decode.worker_id} dropped ({e})") from None
            except WorkerFailed as e:
                self.registry.probe_soon()
                if progress.finished:  # the final message went out; only the stream's close was lost
                    log.info("request %s: %s after its final message; served", job.request_id, e)
                    return
                if progress.sent and progress.done and unmigratable(job) is None:  # only the final message was lost
                    yield progress.final_message()
                    return
                if attempt.produced:  # (a continuation whose worker failed before a token is retried below)
                    self._migrate(job, progress, decode, e, deadline)
                    if job.params.n > 1:  # its sequences go on as requests of their own (below)
                        fan_out = True
                        break
                    current = continuation(job, progress.token_ids, self.config.block_size)
                    stops = self._stop_watch(job, progress)
                    attempts, failures, busy = 0, [], 0
                    admission = Deadline.after(min(self.config.admission_timeout, deadline.remaining()))
                    continue
                failures.append(f"{decode.worker_id}: {e}")
                busy += e.busy
                log.warning("request %s: %s; retrying on another worker", job.request_id, e)
                self.metrics.retry("decode")
            finally:
                self.registry.release(decode)
        if fan_out:
            yield from self._fan_out(job, progress, deadline, cancel, note_cached, tuple(tried))
            return
        if cancel.cancelled:
            raise ServeError(Status.CANCELLED, GONE)
        detail = "; ".join(failures) if failures else "no decode worker is registered"
        if progress.migrations:
            detail = f"{detail}; after {progress.sent} tokens and {progress.migrations} migrations"
        if busy:  # a worker is up but full (the others tried failed): back off and retry
            raise ServeError(Status.RESOURCE_EXHAUSTED, f"the decode workers are full ({detail})")
        raise ServeError(Status.UNAVAILABLE, f"no decode worker could serve the request ({detail})")

    def _stop_watch(self, job: Job, progress: Progress) -> StopWatch | None:
        """Stop strings over a migrated sequence's whole output (None: not needed)."""
        if not progress.migrations or not job.params.stop or self.tokenizer is None:
            return None
        return StopWatch(self.tokenizer, job, progress.token_ids)

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

    def _fan_out(
        self, job: Job, progress: Progress, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None], failed: tuple[WorkerHandle, ...],
    ) -> Iterator[pb.DecodeResponse]:
        """Continue each sequence of an n > 1 request that had not ended as a request
        of its own (`one_sample`), all at once, each on its own thread with its own
        migrations; their messages are merged back under their indices, and their
        final results (with those of the sequences that had ended) make one final
        message. The first failure fails the request (the others are cancelled)."""
        inner = Cancellation()
        cancel.add_callback(inner.cancel)
        merged: queue.Queue[tuple[int, pb.DecodeResponse | BaseException | None]] = queue.Queue()
        final = progress.final_message()
        unfinished = progress.unfinished()
        threads = []
        for index in unfinished:
            sample = Progress(samples={0: replace(progress.sample(index), token_ids=list(progress.sample(index).token_ids))},
                              migrations=progress.migrations)
            serve = self._serve(one_sample(job, index), sample, deadline, inner, note_cached, failed)
            threads.append(threading.Thread(target=_pump, args=(index, serve, merged), daemon=True,
                                            name=f"{job.worker_request_id}-s{index}"))
        for thread in threads:
            thread.start()
        try:
            left = len(threads)
            while left:
                try:
                    index, item = merged.get(timeout=max(0.0, deadline.remaining()) + FAN_OUT_SLACK)
                except queue.Empty:
                    raise ServeError(Status.DEADLINE_EXCEEDED, "deadline passed (migrated samples)") from None
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                message = _as_sample(item, index, final)
                if message.deltas:
                    yield message
        finally:
            inner.cancel()  # the request ended (or failed): nothing of it keeps running
            for thread in threads:
                thread.join(ABORT_TIMEOUT)
        yield final

    def _on(
        self, decode: WorkerHandle, job: Job, attempt: Attempt, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None],
    ) -> Iterator[pb.DecodeResponse]:
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
    ) -> Iterator[pb.DecodeResponse]:
        """D prefills the prompt itself; with `first` (P's first token, which the
        client has), continuing from it instead of sampling another."""
        request = pb.DecodeRequest(
            request_id=attempt.worker_request_id, local_prefill=True, token_ids=job.prompt, sampling=job.options,
            cache_salt=job.cache_salt, first_token=first.token_id if first is not None else None,
        )
        call = decode.stub.Decode(request, timeout=deadline.remaining())
        yield from self._stream(decode, call, attempt, cancel, first)

    def _wants_remote_prefill(self, job: Job, decode: WorkerHandle) -> bool:
        """Whether the prompt should cross from a prefill worker (whether one can is
        asked next): D takes KV, and the part of the prompt D lacks is long enough."""
        if not decode.info.kv_endpoint or job.params.prompt_logprobs is not None:
            return False
        cached = policy.cached_prefix_tokens(job.block_hashes, decode.cached, self.config.block_size)
        return not policy.prefill_locally(len(job.prompt), cached, self.config.local_prefill_threshold)

    # -- the P/D seam ---------------------------------------------------------------------

    def _disaggregated(
        self, decode: WorkerHandle, job: Job, attempt: Attempt, deadline: Deadline, cancel: Cancellation,
        note_cached: Callable[[int], None],
    ) -> Generator[pb.DecodeResponse, None, str | None]:
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
                logprobs = [first] if job.params.logprobs is not None else []
                attempt.produced = True
                yield pb.DecodeResponse(deltas=[pb.SequenceDelta(index=0, token_ids=[first.token_id], logprobs=logprobs,
                                                                 token_logprobs=[first.logprob])])
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
    ) -> Iterator[pb.DecodeResponse]:
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
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # no KV receiver after all, or our hashes differ
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
    ) -> Iterator[pb.DecodeResponse]:
        """Forward D's messages. With `first`, sequence 0's first token came from the
        prefill worker: D's copy of it is dropped, and its logprob (which D did not
        compute) is added to the sequence's cumulative logprob."""
        cancel.add_callback(call.cancel)
        skip_first = first is not None
        first_logprob = first.logprob if first is not None else 0.0
        try:
            for message in call:
                if skip_first:
                    skip_first = not _drop_first_token(message)
                if first_logprob and message.finished:
                    for result in message.results:
                        if result.index == 0:
                            result.cumulative_logprob += first_logprob
                if any(d.token_ids for d in message.deltas) or any(r.token_ids for r in message.results):
                    attempt.produced = attempt.decoded = True
                yield message
        except grpc.RpcError as e:
            if not attempt.decoded and not cancel.cancelled and (_kv_lost(e) or attempt.kv_abandoned):
                raise KVLost(e.details() or "") from None
            raise self._classify(worker, e, cancel, attempt.worker_request_id) from None

    def _classify(self, worker: WorkerHandle, error: grpc.RpcError, cancel: Cancellation, rid: str) -> Exception:
        """A worker call's gRPC error as ours: the caller gone (CANCELLED), a deadline
        passed, a worker failure another worker may not have (WorkerFailed), or the
        worker's own status passed on. The details name the worker's FailureKind
        when it told one (services/common/failure.py)."""
        code = error.code()
        kind = failure_of(error)
        details = error.details() or ""
        if kind is not None:
            details = f"{details} [{wire_name(kind)}]".lstrip()
        if cancel.cancelled:
            _abort_quietly(worker, rid)
            return ServeError(Status.CANCELLED, GONE)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            _abort_quietly(worker, rid)
            return ServeError(Status.DEADLINE_EXCEEDED, f"deadline passed ({error.details()})")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED):
            why = "dropped" if worker.dropped else f"{code.name}: {details}"
            return WorkerFailed(f"worker {worker.worker_id} {why}", busy=code == grpc.StatusCode.RESOURCE_EXHAUSTED)
        return ServeError(status_of_rpc(code), details or code.name)


def _pump(index: int, serve: Iterator[pb.DecodeResponse],
          out: "queue.Queue[tuple[int, pb.DecodeResponse | BaseException | None]]") -> None:
    """A migrated sample's messages onto the merged queue, then how it ended (None: done)."""
    try:
        for message in serve:
            out.put((index, message))
    except BaseException as e:  # handed to the request's thread, which raises it
        out.put((index, e))
        return
    out.put((index, None))


def _as_sample(message: pb.DecodeResponse, index: int, final: pb.DecodeResponse) -> pb.DecodeResponse:
    """A migrated sample's message (its sequence is 0) as sequence `index` of the
    request; a final message's result and counts go into `final`, sent at the end."""
    for delta in message.deltas:
        delta.index = index
    if not message.finished:
        return message
    for result in message.results:
        if result.index == 0:
            result.index = index
            kept = [r for r in final.results if r.index != index]
            del final.results[:]
            final.results.extend(sorted([*kept, result], key=lambda r: r.index))
    final.num_draft_tokens += message.num_draft_tokens
    final.num_accepted_tokens += message.num_accepted_tokens
    if not final.num_cached_tokens:  # the first continuation's (rebase kept it to the original prompt)
        final.num_cached_tokens = message.num_cached_tokens
    if not final.prompt_logprobs:
        final.prompt_logprobs.extend(message.prompt_logprobs)
    message.finished = False
    del message.results[:]
    del message.prompt_logprobs[:]
    return message


def prefill_request(job: Job, rid: str, reservation: pb.ReserveResponse) -> pb.PrefillRequest:
    """What the prefill worker is asked: the prompt, and where and how its KV goes
    (the decode worker's transfer plan, carried unread)."""
    return pb.PrefillRequest(
        request_id=rid, token_ids=job.prompt, sampling=job.options, cache_salt=job.cache_salt,
        transfer_plan=reservation.transfer_plan, block_hashes=job.block_hashes,
    )


def _drop_first_token(message: pb.DecodeResponse) -> bool:
    """Remove sequence 0's first token (already forwarded from Prefill); True if done."""
    for delta in message.deltas:
        if delta.index == 0 and delta.token_ids:
            if len(delta.logprobs) == len(delta.token_ids):
                del delta.logprobs[0]
            if len(delta.token_logprobs) == len(delta.token_ids):
                del delta.token_logprobs[0]
            del delta.token_ids[0]
            return True
    return False


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

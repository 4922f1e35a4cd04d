"""The router's front end: everything a request meets on the router but its framing.

    adapter (gRPC now, HTTP next)      FrontEnd.generate(Request)
    -----------------------------      --------------------------
    its request -> Request    ------>  draining?                       UNAVAILABLE
    (sampling refused: refuse(error)   INVALID_ARGUMENT "<field>: ...", counted)
                                       tenant (--salt-cache-by-key)    UNAUTHENTICATED
                                       validate -> Job                 INVALID_ARGUMENT "<field>: ..."
                                       a resume: checked (resume.py)   INVALID_ARGUMENT "resume...: ..."
                                       deadline: the caller's, capped at --request-timeout
                                       admission: a slot, or the queue RESOURCE_EXHAUSTED + retry_after_s
                              <------  Generation (an iterator of SequenceOutput)
    for output in stream:              dispatch: attempts, prefill paths, fallbacks,
        send(output)                   migration (dispatch.py); each worker update
    caller gone: stream.cancel()       (events.py) -> outputs (responses.py); drain's
                                       grace over: UNAVAILABLE
    done/failed: stream.close()        end: slot freed, worker calls cancelled,
                                            metrics request_ended(final status)

Every refusal and failure is a ServeError (services/common/status.py), raised by
`generate` or by the iteration; an adapter maps its Status to its framing. Once the
caller is gone (`cancel`), nothing more is said to it: the iteration just ends.

Structured outputs: a request whose constraint passed validation counts in
`pdserve:router_structured_outputs_requests_total{kind}`, a refused one in
`..._refusals_total{reason}` (the workers' refusals are counted by dispatch.py).

The final status (`pdserve:request_failure_total{code}`): the ServeError's; for a
caller gone (cancelled, or the stream closed before its end) DEADLINE_EXCEEDED when
its deadline had passed, else CANCELLED (a client's timer fires first and resets
its stream, while our copy of the deadline lies later by the transit time: within
DEADLINE_TOLERANCE counts as passed); UNKNOWN for an unexpected exception.

Blocking, on the caller's thread: `generate` may wait for an admission slot (up to
--max-queue-wait) and each `next` for the workers. An async adapter runs both in a
worker thread (e.g. `await anyio.to_thread.run_sync(front_end.generate, request)`,
then `next(stream, None)` the same way per output, or one thread pumping outputs
into an asyncio queue with `loop.call_soon_threadsafe`), calls `stream.cancel()`
from the event loop when its client disconnects (thread-safe: the pending `next`
returns at once, the iteration ending), and `stream.close()` from the thread that
iterates (a generator is never closed while another thread runs it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from typing import Self

from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.common.status import ServeError, Status, status_of
from pdserve.services.router.admission import Admission
from pdserve.services.router.api_keys import AUTHORIZATION, ApiKeys
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import Dispatcher
from pdserve.services.router.records import Request, SequenceOutput
from pdserve.services.router.responses import ResponseBuilder
from pdserve.services.router.resume import Resumes
from pdserve.services.router.structured import ConstraintRefused
from pdserve.services.router.validate import Job, Limits, Validator

log = logging.getLogger(__name__)
DEADLINE_TOLERANCE = 0.25  # seconds


class FrontEnd:
    def __init__(
        self, config: RouterConfig, limits: Limits, tokenizer: Tokenizer | None, dispatcher: Dispatcher,
        metrics: RouterMetrics, api_keys: ApiKeys | None = None, resumes: Resumes | None = None,
    ) -> None:
        """Callers are authenticated before a request reaches here (by the adapter:
        api_keys.py's interceptor for gRPC); `api_keys` only names their tenant, with
        --salt-cache-by-key, and the key a resume token is bound to. `resumes` issues
        and checks resume tokens (resume.py; None: none issued, resumes refused)."""
        self.config = config
        self.limits = limits
        self.tokenizer = tokenizer
        self.validator = Validator(limits, tokenizer)
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.api_keys = api_keys
        self.resumes = resumes or Resumes(None)
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests, config.max_queue_wait)
        self._inflight = 0
        self._idle = threading.Condition()
        self._closing = threading.Event()  # draining: admit nothing new
        self._cut = threading.Event()  # the drain's grace ran out: fail what is left

    def generate(self, request: Request) -> Generation:
        """Admit `request`: its stream of outputs, holding an admission slot until it
        is closed (iterating to the end closes it). Raises ServeError: UNAVAILABLE
        (draining), UNAUTHENTICATED, INVALID_ARGUMENT naming the field, or
        RESOURCE_EXHAUSTED with retry_after_s (no slot within --max-queue-wait)."""
        arrival = time.monotonic()
        self.metrics.request_started()
        self._count(1)
        try:
            if self._closing.is_set():
                raise ServeError(Status.UNAVAILABLE, "router: shutting down (draining), admitting no request")
            tenant = self._tenant(request.authorization)
            try:  # a bad request is refused before it waits for a slot
                job = self.validator.validate(request, tenant)
            except ValueError as e:
                self._count_refusal(e)
                raise ServeError(status_of(e), str(e)) from None
            key_id = self._key_id(request) if request.resumable or request.resume is not None else ""
            if request.resume is not None:
                try:
                    job = self.resumes.job(job, request.resume, self.limits.model_name, key_id,
                                           self.limits.vocab_size, self.limits.max_model_len)
                except ValueError as e:
                    raise ServeError(Status.INVALID_ARGUMENT, str(e)) from None
                if job.resumed:
                    self.metrics.request_resumed()
            if job.params.structured_outputs is not None:
                self.metrics.structured_request(job.params.structured_outputs.kind.value)
            deadline = self._deadline(request.deadline)
            if not self.admission.acquire(deadline.remaining()):
                raise self._refusal()
        except BaseException as e:
            self._ended(e.status if isinstance(e, ServeError) else Status.UNKNOWN)
            raise
        token = self.resumes.token(job, self.limits.model_name, key_id) if request.resumable else None
        return Generation(self, job, deadline, ResponseBuilder(job, self.tokenizer, arrival, self.metrics, token))

    def refuse(self, error: ValueError) -> ServeError:
        """The INVALID_ARGUMENT of a request its adapter could not build (a sampling
        field the engine's SamplingParams refused, naming it), counted as a refusal
        of `generate` is."""
        refusal = ServeError(status_of(error), str(error))
        self._count_refusal(error)
        self.metrics.request_started()
        self.metrics.request_ended(refusal.status.name)
        return refusal

    def _count_refusal(self, error: ValueError) -> None:
        """A refused constraint, by reason (structured.py names them; any other error
        about the constraint, e.g. a gRPC message's, is "malformed")."""
        if isinstance(error, ConstraintRefused):
            self.metrics.structured_refusal(error.reason)
        elif str(error).startswith("structured_outputs"):
            self.metrics.structured_refusal("malformed")

    def drain(self, grace: float) -> bool:
        """Admit no new request (UNAVAILABLE), let those in flight finish for up to
        `grace` seconds, then fail the rest with UNAVAILABLE (at their next message).
        True when nothing was left to fail."""
        self._closing.set()
        give_up = time.monotonic() + grace
        with self._idle:
            drained = self._idle.wait_for(lambda: self._inflight == 0, timeout=grace)
        if not drained:
            log.warning("router: %d requests left after a %.0fs drain: failing them", self._inflight, grace)
            self._cut.set()
            with self._idle:
                self._idle.wait_for(lambda: self._inflight == 0, timeout=max(1.0, give_up - time.monotonic()))
        return drained

    @property
    def draining(self) -> bool:
        """Admitting nothing new (drain was called)."""
        return self._closing.is_set()

    @property
    def cut(self) -> bool:
        """The drain's grace ran out: requests still running fail."""
        return self._cut.is_set()

    def retry_hint(self, error: ServeError) -> None:
        """Say when to retry on a RESOURCE_EXHAUSTED `error` (the workers are full)."""
        if error.status is Status.RESOURCE_EXHAUSTED and error.retry_after_s is None:
            error.retry_after_s = self.admission.retry_after()

    def _refusal(self) -> ServeError:
        retry_after = self.admission.retry_after()
        cfg = self.config
        return ServeError(
            Status.RESOURCE_EXHAUSTED,
            f"router: {cfg.max_concurrent_requests} requests in flight (--max-concurrent-requests) and "
            f"{cfg.max_queued_requests} waiting (--max-queued-requests, --max-queue-wait "
            f"{cfg.max_queue_wait:g}s); retry after {int(retry_after * 1000)} ms", retry_after_s=retry_after,
        )

    def _tenant(self, authorization: str) -> str | None:
        if not self.config.salt_cache_by_key or self.api_keys is None:
            return None
        tenant = self.api_keys.identify({AUTHORIZATION: authorization})
        if tenant is None:  # the key was revoked since the adapter let the call in
            raise ServeError(Status.UNAUTHENTICATED, "API key not valid")
        return tenant

    def _key_id(self, request: Request) -> str:
        """The caller's API key id, which a resume token is bound to ("" without keys)."""
        if self.api_keys is None:
            return ""
        return self.api_keys.identify({AUTHORIZATION: request.authorization}) or ""

    def _deadline(self, caller: Deadline | None) -> Deadline:
        longest = self.config.request_timeout
        return Deadline.after(longest if caller is None else min(caller.remaining(), longest))

    def _ended(self, failure: Status | None) -> None:
        self.metrics.request_ended(None if failure is None else failure.name)
        self._count(-1)

    def _count(self, delta: int) -> None:
        with self._idle:
            self._inflight += delta
            if self._inflight == 0:
                self._idle.notify_all()


class Generation:
    """One admitted request's outputs, in order: an iterator of SequenceOutput that
    raises ServeError when the request fails. `cancel()` (any thread): the caller is
    gone. `close()` (or `with`): the adapter is done with it; frees its slot and
    cancels what still runs on the workers. Iterating to the end closes it too."""

    def __init__(self, front_end: FrontEnd, job: Job, deadline: Deadline, builder: ResponseBuilder) -> None:
        self.request_id = job.request_id  # the caller's, or the one the router assigned
        self.prompt_token_ids = job.prompt
        self.status: Status | None = None  # once over: how it ended (None: it succeeded)
        self._front_end = front_end
        self._job = job
        self._deadline = deadline
        self._builder = builder
        self._cancellation = Cancellation()
        self._over = False
        self._outputs = self._run()

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> SequenceOutput:
        return next(self._outputs)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cancel(self) -> None:
        self._cancellation.cancel()

    def close(self) -> None:
        self._outputs.close()  # ends a started run (its `finally`); one never started ends here
        self._end(self._gone())

    def _run(self) -> Iterator[SequenceOutput]:
        front_end, job = self._front_end, self._job
        status: Status | None = Status.UNKNOWN
        try:
            run = front_end.dispatcher.run(job, self._deadline, self._cancellation, self._builder.note_cached_tokens)
            with closing(run) as messages:
                for message in messages:
                    if front_end.cut:
                        raise ServeError(Status.UNAVAILABLE, "router: shut down before the request ended")
                    yield from self._builder.messages(message)
            status = None
        except ServeError as e:
            if self._cancellation.cancelled:
                status = self._gone()
                log.info("request %s: client gone, aborted on the workers", job.request_id)
                return
            status = e.status
            front_end.retry_hint(e)
            raise
        except GeneratorExit:  # the adapter stopped reading: its caller left
            status = self._gone()
            raise
        except BaseException:  # unexpected: UNKNOWN, unless the caller had left anyway
            if self._cancellation.cancelled:
                status = self._gone()
            raise
        finally:
            self._end(status)

    def _gone(self) -> Status:
        """The status of a request whose caller left."""
        expired = self._deadline.remaining() <= DEADLINE_TOLERANCE
        return Status.DEADLINE_EXCEEDED if expired else Status.CANCELLED

    def _end(self, status: Status | None) -> None:
        if self._over:
            return
        self._over = True
        self.status = status
        self._cancellation.close()
        self._front_end.admission.release()
        self._front_end._ended(status)

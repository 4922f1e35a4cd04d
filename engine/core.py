"""Stepping: schedule, run the model, sample; keep each failure to the requests behind it.

    step():  schedule -> execute -> per request: prompt logprobs, computed tokens,
             fan-out -> sample -> append tokens, stops -> beam steps -> finished outputs

Failure isolation. A request that makes the step fail fails alone, where that can be
known; every other request goes on as if nothing happened:
  - the forward pass raises: the batch is bisected and re-run without the half that
    fails, down to the single request that fails alone (re-running only rewrites the
    same KV into the same slots, and nothing else has changed yet);
  - sampling the batch raises: its rows are sampled one by one;
  - anything per request (prompt logprobs, fan-out, appending a token, a stop string,
    the token hook, a beam step) fails that request's group only.
A constraint (structured outputs, engine/structured/) that does not compile, not within
its deadline, or that its grammar engine gives up on while decoding (ConstraintError),
fails its request alone (INVALID_CONSTRAINT, CONSTRAINT_TIMEOUT).
A failed request ends like an abort (finish_reason "abort", `RequestOutput.error` and
`RequestOutput.failure`: INTERNAL, or NO_ROOM for one that can never fit the pool),
its blocks freed, and a log line names it. Whatever else escapes fails the requests
of this step's batch, never the engine: every path out frees their blocks.

Structured outputs. A constrained request is admitted at once, but enters the
scheduler only when its grammar has compiled (polled at the start of each step, never
waited for while anything can run); what was to happen on admission (queueing, a first
token, a commit of remote KV) waits with it (`when_ready`). Its rows are masked before
the sampler; `apply_token` advances the matcher; a complete grammar ends the sequence
("stop"). Constrained sequences speculate like the others: their drafts are cut where
the grammar refuses one (`_constrain_drafts`, before the forward pass), and each of a
verification's K+1 rows takes the grammar's mask at its own position (the matcher
walks the drafts and rolls back: manager.py), so a draft is kept exactly when the
masked sampler would have chosen it without speculation (lossless, valid).

Stalls. When nothing can run (only beams waiting for a sibling that cannot get
blocks), the group at the head of the queue (the oldest with a waiting sequence: the
queue is in priority order) gets the pool: every other group's running beams are
preempted (recomputed later). Only when nothing else holds blocks and it still
cannot fit does it fail: a request that fits in the pool never aborts.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.beam import BeamSearch
from pdserve.engine.errors import ConstraintError, FailureKind
from pdserve.engine.export import LayerHook, layer_callback
from pdserve.engine.forking import Forker
from pdserve.engine.group import SequenceGroup
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.model_runner import BatchItem, ModelRunner
from pdserve.engine.output import OutputProcessor
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams, check_field
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.spec.draft_state import DraftState
from pdserve.engine.spec.speculator import Speculator
from pdserve.engine.spec.verify import accept_matching, positions
from pdserve.engine.structured.manager import MaskRows, StructuredOutputsManager
from pdserve.engine.validation import MAX_REQUEST_ID

log = logging.getLogger(__name__)

Scheduled = list[tuple[Request, int]]
# What a sampler row is sampled for: a sequence's next token, or (with drafts) one of
# the K+1 positions of its verification.
SampleJob = tuple[Request, int]  # (sequence, number of rows: 1, or K+1)
# What waits for a constrained group's grammar: run with the step's finished outputs.
ReadyAction = Callable[[list[RequestOutput]], None]
# The longest a step with nothing to run waits for a grammar being compiled.
IDLE_COMPILE_WAIT = 0.005


class EngineCore:
    def __init__(
        self, runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler, sampler: Sampler,
        output: OutputProcessor, eos_token_ids: tuple[int, ...], speculator: Speculator | None = None,
        structured: StructuredOutputsManager | None = None,
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.scheduler = scheduler
        self.sampler = sampler
        self.output = output
        self.eos_token_ids = eos_token_ids
        self.speculator = speculator
        self.structured = structured
        self._on_ready: dict[str, list[ReadyAction]] = {}  # constrained groups waiting for their grammar
        self.groups: dict[str, SequenceGroup] = {}
        # Prefill role: finished requests whose blocks wait to be shipped, and the
        # hook told after each layer which exported tokens it has written.
        self.held: dict[str, Request] = {}
        self.held_drafts: dict[str, DraftState] = {}  # of held requests: the EAGLE head's state to ship
        self.layer_hook: LayerHook | None = None
        self._seq_group: dict[str, SequenceGroup] = {}
        self._numbers = itertools.count()  # arrival numbers of groups and sequences (priority)
        self.forker = Forker(kv, runner, scheduler, self.track, self._on_sample)
        self.last_batch: tuple[int, int] = (0, 0)  # (sequences, tokens) the last step ran: for metrics
        self.last_scheduled: tuple[str, ...] = ()  # request ids of the last step's batch (failure isolation)

    # -- groups -------------------------------------------------------------------------

    def new_group(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        block_hashes: Sequence[bytes] = (),
    ) -> Request:
        """Register a request's group; its first sequence (not yet scheduled).
        `block_hashes`: the prompt's, computed (and checked) by the caller, so the
        prompt is not hashed again here (none: hashed here)."""
        check_field(isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID, "request_id",
                    f"must be a string of 1..{MAX_REQUEST_ID} characters", request_id)
        if request_id in self.groups or request_id in self.held:
            raise ValueError(f"request_id: {request_id!r} is already running")
        request = Request(
            request_id, list(prompt_token_ids), params, self.kv.block_size, eos_token_ids=self.eos_token_ids,
            block_hashes=list(block_hashes),
        )
        beam = None
        constraint = params.structured_outputs
        if params.use_beam_search and self.speculator is not None:
            self.speculator.skip()  # beams fork every step: no drafts
        if params.use_beam_search:
            # HF's beam search takes stop ids as more EOS ids
            eos = () if params.ignore_eos else self.eos_token_ids
            beam = BeamSearch(params, len(prompt_token_ids), tuple(dict.fromkeys((*eos, *params.stop_token_ids))))
        group = SequenceGroup(
            request_id, params, list(prompt_token_ids), [request], beam=beam,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        request.priority = (next(self._numbers), 0)
        self.groups[request_id] = group
        self.track(request, group)
        if constraint is not None:
            if self.structured is None:
                raise ValueError("structured_outputs: this engine has no tokenizer.json to compile grammars for")
            self.structured.start(request_id, constraint)
            self._on_ready[request_id] = []
        return request

    def when_ready(self, group: SequenceGroup, action: ReadyAction, finished: list[RequestOutput]) -> None:
        """Run `action` now, or, while the group's grammar compiles, once it has (in a
        step, whose outputs then carry what it finishes)."""
        waiting = self._on_ready.get(group.request_id)
        if waiting is None:
            action(finished)
            return
        waiting.append(action)
        # Compiled already (a cache hit): no need to wait for a step, unless resumed tokens
        # must enter the matcher first (they may not match: a failure a step reports).
        if (self.structured is not None and not group.params.resumed_tokens
                and self.structured.take_if_compiled(group.request_id)):
            self._admit_compiled([group.request_id], finished)

    def _poll_grammars(self, finished: list[RequestOutput]) -> None:
        """Start the groups whose grammar compiled; fail those refused or too slow."""
        structured = self.structured
        if structured is None or not self._on_ready:
            return
        ready, failed = structured.poll()
        for failure in failed:
            group = self.groups.get(failure.group_id)
            if group is not None:
                log.info("request %s: %s", failure.group_id, failure.reason)
                finished.append(self.abort_group(group, failure.reason, failure.kind))
        self._admit_compiled(ready, finished)

    def _admit_compiled(self, group_ids: list[str], finished: list[RequestOutput]) -> None:
        """Build the matchers of groups whose grammar is ready; run what waited for it."""
        structured = self.structured
        if structured is None:
            return
        for group_id in group_ids:
            group = self.groups.get(group_id)
            actions = self._on_ready.pop(group_id, None)
            if group is None or actions is None:
                continue
            try:
                for seq in group.live:
                    resumed = seq.prompt_token_ids[len(seq.prompt_token_ids) - group.params.resumed_tokens:]
                    structured.attach(group_id, seq.request_id, resumed + seq.output_token_ids)
            except ValueError as exc:  # resumed tokens the grammar does not allow
                structured.compiler.refused("invalid")
                finished.append(self.abort_group(group, str(exc), FailureKind.INVALID_CONSTRAINT))
                continue
            except Exception as exc:  # the backend failed building a matcher
                self.fail(group, exc, finished)
                continue
            for action in actions:
                if self.groups.get(group_id) is not group:
                    break
                try:
                    action(finished)
                except Exception as exc:
                    self.fail(group, exc, finished)

    def _on_sample(self, parent: Request, child: Request) -> None:
        """A sample forked off the prompt: the proposer's copy, its own matcher."""
        if self.speculator is not None:
            self.speculator.fork(parent.request_id, child.request_id)
        if self.structured is not None:
            self.structured.fork(parent.request_id, child.request_id)

    def track(self, seq: Request, group: SequenceGroup) -> None:
        seq.priority = (seq.priority[0], next(self._numbers))  # a fork: after its siblings
        self._seq_group[seq.request_id] = group
        self.output.track(seq, group)

    def drop_group(self, request_id: str) -> None:
        """Forget a group that never ran (a reservation that found no room)."""
        group = self.groups.pop(request_id)
        for seq in group.live:
            self._seq_group.pop(seq.request_id, None)
            self.output.untrack(seq)
            self.kv.free(seq.request_id)
        self.scheduler.shrink_group(request_id, 0)
        self._forget_constraint(request_id)

    def _forget_constraint(self, group_id: str) -> None:
        self._on_ready.pop(group_id, None)
        if self.structured is not None:
            self.structured.forget_group(group_id)

    def finish_seq(self, group: SequenceGroup, seq: Request, status: RequestStatus, keep: bool = True) -> None:
        """Every path out of a sequence: out of the queues, blocks freed (or held for
        shipping), text finished; `keep=False` for a dropped beam (not a result)."""
        hold = seq.export_kv and status != RequestStatus.FINISHED_ABORTED
        self.scheduler.finish(seq, status, free=not hold)
        if hold:
            self.held[seq.request_id] = seq
        self._seq_group.pop(seq.request_id, None)
        if self.speculator is not None:
            if hold:
                self._export_draft(self.speculator, seq)
            self.speculator.release(seq.request_id)
        if self.structured is not None:
            self.structured.release(seq.request_id)
        self.output.untrack(seq)
        group.pending.pop(seq.request_id, None)
        if seq in group.live:
            group.live.remove(seq)
        if keep:
            group.finished.append(seq)
        self.scheduler.shrink_group(group.request_id, group.num_seqs_left)

    def end_if_done(self, group: SequenceGroup, finished: list[RequestOutput]) -> None:
        if group.done and self.groups.pop(group.request_id, None) is not None:
            self._forget_constraint(group.request_id)
            finished.append(self.output.build(group))

    def abort_group(
        self, group: SequenceGroup, error: str | None = None, failure: FailureKind = FailureKind.INTERNAL,
    ) -> RequestOutput:
        """End a request wherever it is; its output (for beams: the n best so far).
        With `error` the engine failed it, as `failure` says (RequestOutput.failure)."""
        if group.beam is not None and group.beams_at_abort is None:
            group.beams_at_abort = group.beam.best(group.params.n, [b.output_token_ids for b in group.live])
        if group.error is None and error is not None:
            group.error, group.failure = error, failure
        for seq in list(group.live):
            self.finish_seq(group, seq, RequestStatus.FINISHED_ABORTED)
        self.groups.pop(group.request_id, None)
        self._forget_constraint(group.request_id)
        return self.output.build(group)

    def fail(self, group: SequenceGroup, exc: BaseException, finished: list[RequestOutput]) -> None:
        """A failure this request caused: it ends, alone."""
        if self.groups.get(group.request_id) is not group:
            return  # already ended
        if isinstance(exc, ConstraintError):  # the request's grammar, not the engine
            log.info("request %s: %s", group.request_id, exc)
            finished.append(self.abort_group(group, str(exc), FailureKind.INVALID_CONSTRAINT))
            return
        log.error("request %s failed in an engine step: %s: %s", group.request_id, type(exc).__name__, exc,
                  exc_info=exc)
        finished.append(self.abort_group(group, f"engine: {type(exc).__name__}: {exc}"))

    def apply_token(
        self, group: SequenceGroup, seq: Request, token: int, logprob: float | None, top: dict[int, float] | None,
        finished: list[RequestOutput],
    ) -> bool:
        """Append one token (the one place tokens are appended, but beams': a constraint's
        matcher advances here); whether it ended the sequence."""
        complete = self.structured is not None and self.structured.accept(seq.request_id, token)
        status = self.output.append(group, seq, token, logprob, top, complete)
        if status is not None:
            self.finish_seq(group, seq, status)
            self.end_if_done(group, finished)
        return status is not None

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of finished requests."""
        started = time.perf_counter()
        self.last_scheduled = ()
        compiled: list[RequestOutput] = []
        self._poll_grammars(compiled)
        if self.speculator is not None:
            self._propose(self.speculator)
        plan = self.scheduler.schedule()
        try:
            finished = self._step(plan)
            if not plan.scheduled and self.structured is not None and self.structured.num_pending:
                self.structured.wait(IDLE_COMPILE_WAIT)  # nothing to run: let the busy caller breathe
            return compiled + finished
        finally:
            if self.speculator is not None:
                self.speculator.step_done(time.perf_counter() - started, _decoding_only(plan.scheduled))

    def _step(self, plan: SchedulerOutput) -> list[RequestOutput]:
        self.last_batch = (len(plan.scheduled), plan.num_tokens)
        self.last_scheduled = tuple(dict.fromkeys(
            g.request_id for r, _ in plan.scheduled if (g := self._seq_group.get(r.request_id)) is not None))
        if not plan.scheduled:
            return self._resolve_stall(plan.preempted, plan.preempted_self)
        finished: list[RequestOutput] = []
        try:
            self._run(plan.scheduled, finished)
        except Exception as exc:  # escaped the isolation below (a bug): fail this batch, not the engine
            log.exception("engine step failed outside per-request isolation")
            for request, _ in plan.scheduled:
                group = self._seq_group.get(request.request_id)
                if group is not None:
                    self.fail(group, exc, finished)
        return finished

    def _propose(self, speculator: Speculator) -> None:
        """This step's drafts. A proposer that fails (a fault in the draft model) costs this
        step its drafts, never a request: verification is what decides the tokens."""
        running = self.scheduler.running
        try:
            speculator.propose(running, self._may_draft)
        except Exception as exc:
            log.warning("speculative proposer failed (%s: %s): this step runs without drafts", type(exc).__name__, exc)
            for request in running:
                request.spec_token_ids.clear()
            return
        if self.structured is not None:
            self._constrain_drafts(self.structured, running)

    def _constrain_drafts(self, structured: StructuredOutputsManager, running: Sequence[Request]) -> None:
        """Cut each constrained sequence's drafts at the first one its grammar refuses (and
        after one that completes it): no slot is scored for a draft that could never be
        emitted. A matcher that fails here costs the sequence its drafts this step (its
        mask, next, fails the request)."""
        for request in running:
            drafts = request.spec_token_ids
            if not drafts or not structured.has(request.request_id):
                continue
            try:
                del drafts[structured.valid_drafts(request.request_id, drafts):]
            except Exception as exc:
                log.info("request %s: drafts dropped: %s: %s", request.request_id, type(exc).__name__, exc)
                drafts.clear()

    def _may_draft(self, request: Request) -> bool:
        """A running sequence that is decoding: all but its newest output token computed,
        not a beam (constrained or not: its grammar cuts and masks its drafts). (A prompt
        whose last token is recomputed, as after a commit of remote KV without a first
        token, looks the same but has no output yet: it samples, and fans out, as usual.)"""
        group = self._seq_group.get(request.request_id)
        return (group is not None and group.beam is None and not group.needs_fan_out
                and request.status == RequestStatus.RUNNING
                and request.num_output_tokens > 0
                and request.num_computed_tokens == request.num_tokens - 1)

    def _run(self, scheduled: Scheduled, finished: list[RequestOutput]) -> None:
        samples: list[tuple[list[SampleJob], torch.Tensor]] = []  # per sub-batch: jobs, their logits rows
        beams: list[tuple[SequenceGroup, Request, torch.Tensor]] = []
        for batch, logits, spans in self._execute(scheduled, finished):
            jobs: list[SampleJob] = []
            rows: list[int] = []
            for (request, n), (first, num_rows) in zip(batch, spans):
                group = self._seq_group.get(request.request_id)
                if group is None:
                    continue
                try:
                    ready = self._advance(group, request, n, logits[first : first + num_rows])
                except Exception as exc:
                    self.fail(group, exc, finished)
                    continue
                row = first + num_rows - 1
                if ready and group.beam is not None:
                    beams.append((group, request, logits[row]))
                    continue
                if ready and request.spec_token_ids:  # a verification: its K+1 rows
                    jobs.append((request, num_rows))
                    rows += range(first, first + num_rows)
                    continue
                jobs += [(seq, 1) for seq in ready]
                rows += [row] * len(ready)
            if jobs:
                samples.append((jobs, logits.index_select(0, torch.tensor(rows, device=logits.device))))
        if samples:
            logits = samples[0][1] if len(samples) == 1 else torch.cat([rows for _, rows in samples])
            self._sample([job for jobs, _ in samples for job in jobs], logits, finished)
        for group, request, row_logits in beams:
            if self._seq_group.get(request.request_id) is not group:
                continue
            try:
                self._beam_step(group, request, row_logits, finished)
            except Exception as exc:
                self.fail(group, exc, finished)

    def _execute(self, scheduled: Scheduled, finished: list[RequestOutput]) -> list[tuple[Scheduled, torch.Tensor, list]]:
        """Run the forward pass; when it raises, bisect: each half runs again on its own,
        down to the single request that fails alone (failed, and left out)."""
        try:
            batch = [BatchItem(r, n, self.kv.block_ids(r.request_id), tuple(r.spec_token_ids)) for r, n in scheduled]
            capture = self.speculator.capture() if self.speculator is not None else None
            logits, spans = self.runner.execute(batch, layer_callback(self.layer_hook, scheduled, self.kv), capture)
            if capture is not None and capture.features is not None:
                self._observe(scheduled, capture.features)
            return [(scheduled, logits, spans)]
        except Exception as exc:
            if len(scheduled) == 1:
                group = self._seq_group.get(scheduled[0][0].request_id)
                if group is not None:
                    self.fail(group, exc, finished)
                return []
            log.warning("forward pass of %d requests failed (%s): bisecting", len(scheduled), exc)
            mid = len(scheduled) // 2
            return self._execute(scheduled[:mid], finished) + self._execute(scheduled[mid:], finished)

    def _observe(self, scheduled: Scheduled, features: torch.Tensor) -> None:
        """Hand the proposer the target's features of every sequence that may speculate
        (not a beam): item i's rows, from its first position computed this step; then
        let it take in the prompt rows among them (Speculator.prime)."""
        speculator = self.speculator
        if speculator is None:
            return
        first, observed = 0, []
        for request, n in scheduled:
            group = self._seq_group.get(request.request_id)
            if group is not None and group.beam is None:
                speculator.observe(request.request_id, request.num_computed_tokens, features[first : first + n])
                observed.append(request)
            first += n
        try:
            speculator.prime(observed)
        except Exception as exc:  # a fault in the head costs drafts, never a request
            log.warning("speculative proposer failed to take in prompts (%s: %s)", type(exc).__name__, exc)

    def _export_draft(self, speculator: Speculator, seq: Request) -> None:
        try:
            draft = speculator.export(seq)
        except Exception as exc:  # the decode worker's head then starts at its first token
            log.warning("speculative proposer failed to export %r (%s: %s)", seq.request_id, type(exc).__name__, exc)
            return
        if draft is not None:
            self.held_drafts[seq.request_id] = draft

    def _advance(self, group: SequenceGroup, request: Request, n: int, rows: torch.Tensor) -> list[Request]:
        """Account for the n tokens just computed; the sequences that sample from this
        request's last row now (after the prompt: its fan-out)."""
        if group.prompt_logprobs is not None and request.num_computed_tokens < request.num_prompt_tokens:
            self.output.record_prompt_logprobs(group, request, rows)
        # Drafts' KV was written too, but counts only once verification accepts them.
        request.num_computed_tokens += n - len(request.spec_token_ids)
        self.kv.cache_full_blocks(request)
        if rows.shape[0] == 0 or request.num_computed_tokens < request.num_tokens:
            return []
        if group.beam is not None:
            return [request]
        return self.forker.fan_out(group, request)

    def _sample(self, jobs: list[SampleJob], logits: torch.Tensor, finished: list[RequestOutput]) -> None:
        """Sample every row in one call (a verification's rows at their own positions), then
        apply each job's tokens."""
        views = [view for seq, num_rows in jobs for view in (positions(seq) if num_rows > 1 else [seq])]
        if self.structured is not None:  # before the sampler: logprobs are the constrained distribution's
            self._mask(self.structured, jobs, logits, finished)
        try:
            result = self.sampler(logits, views)
            samples: list[tuple | None] = list(zip(result.token_ids, result.logprobs, result.top_logprobs))
        except Exception as exc:
            log.warning("sampling %d rows failed (%s): sampling them one by one", len(views), exc)
            samples = self._sample_each(views, logits, finished)
        at = 0
        for seq, num_rows in jobs:
            rows, at = samples[at : at + num_rows], at + num_rows
            group = self._seq_group.get(seq.request_id)
            if group is None or any(row is None for row in rows):
                continue  # its group failed meanwhile
            try:
                if num_rows == 1:
                    self.apply_token(group, seq, *rows[0], finished)
                else:
                    self._apply_verified(group, seq, rows, finished)
            except Exception as exc:
                self.fail(group, exc, finished)

    def _mask(self, structured: StructuredOutputsManager, jobs: list[SampleJob], logits: torch.Tensor,
              finished: list[RequestOutput]) -> None:
        """Mask the rows of constrained sequences: one row, or a verification's K+1 rows,
        each at its own position in the grammar (StructuredOutputsManager.mask). A matcher
        that fails fails its request; its rows are sampled and then dropped."""
        rows: list[MaskRows] = []
        at = 0
        for seq, num_rows in jobs:
            if structured.has(seq.request_id):
                rows.append((at, seq.request_id, seq.spec_token_ids if num_rows > 1 else ()))
            at += num_rows
        try:
            structured.mask(logits, rows)
        except Exception:
            for one in rows:
                try:
                    structured.mask(logits, [one])
                except Exception as exc:
                    group = self._seq_group.get(one[1])
                    if group is not None:
                        self.fail(group, exc, finished)

    def _apply_verified(self, group: SequenceGroup, seq: Request, rows: list, finished: list[RequestOutput]) -> None:
        """Append what a verification keeps, one token at a time, each through the stop
        checks: the first stop ends the run there, and nothing after it is appended,
        streamed or counted. Each appended draft's KV (written by this pass) becomes
        computed; the last token's KV is computed next step, as without speculation."""
        drafts = list(seq.spec_token_ids)
        seq.spec_token_ids.clear()
        emitted = accept_matching(drafts, [token for token, _, _ in rows])
        num_accepted = len(emitted) - 1
        # Counted before appending: the token that ends the sequence builds its output.
        seq.num_draft_tokens += len(drafts)
        before = seq.num_accepted_tokens
        for i, token in enumerate(emitted):
            if i:
                seq.num_computed_tokens += 1  # the draft before this token
            seq.num_accepted_tokens += i < num_accepted
            if self.apply_token(group, seq, token, rows[i][1], rows[i][2], finished):
                break
        else:
            self.kv.cache_full_blocks(seq)
            self.kv.trim(seq)  # what only rejected drafts held goes back to the pool
        if self.speculator is not None:
            self.speculator.record(seq.request_id, len(drafts), num_accepted, seq.num_accepted_tokens - before)

    def _sample_each(self, views: list, logits: torch.Tensor, finished: list[RequestOutput]) -> list[tuple | None]:
        samples: list[tuple | None] = []
        for i, view in enumerate(views):
            try:
                result = self.sampler(logits[i : i + 1], [view])
            except Exception as exc:
                group = self._seq_group.get(view.request_id)
                if group is not None:
                    self.fail(group, exc, finished)
                samples.append(None)
                continue
            samples.append((result.token_ids[0], result.logprobs[0], result.top_logprobs[0]))
        return samples

    def _beam_step(self, group: SequenceGroup, seq: Request, logits: torch.Tensor, finished: list[RequestOutput]) -> None:
        log_probs = self.forker.beam_log_probs(group, seq, logits)
        if log_probs is None or group.beam is None:
            return
        step = group.beam.step(log_probs, [b.output_token_ids for b in group.live])
        if step.done:
            for beam in list(group.live):
                self.finish_seq(group, beam, RequestStatus.FINISHED_STOPPED)
            self.end_if_done(group, finished)
            return
        for dropped in self.forker.reform(group, step):
            self.finish_seq(group, dropped, RequestStatus.FINISHED_ABORTED, keep=False)

    # -- stalls -------------------------------------------------------------------------

    def _resolve_stall(self, preempted: list[Request], preempted_self: list[Request]) -> list[RequestOutput]:
        """Nothing could run this step. Unless something will free blocks by itself (a
        running sequence with work, held or reserved KV, whose deadlines free it; a
        preemption whose room the queue's head has not tried yet), give the pool to
        the group at the head of the queue: preempt every other group's running beams.
        If nothing else holds blocks, it can never fit: fail it. (A head that has just
        preempted itself is not retried: admitted chunk by chunk, it would fill the
        pool and preempt itself again forever.)"""
        sched = self.scheduler
        if not sched.waiting or self.held or self._waiting_for_remote_kv():
            return []
        if preempted and not (len(preempted) == len(preempted_self) and sched.waiting[0] in preempted_self):
            return []
        if any(r.num_computed_tokens < r.num_tokens for r in sched.running):
            return []
        head = self._seq_group[sched.waiting[0].request_id]
        others = [g for g in self.groups.values() if g is not head and any(_running(s) for s in g.live)]
        if others:  # younger than the head (its waiting sequences come first): they wait behind it
            log.info("kv cache stalled: preempting %d groups so that %s can run", len(others), head.request_id)
            for group in others:
                for seq in [s for s in group.live if _running(s)]:
                    sched.preempt(seq)
            return []
        log.warning("request %s can never fit in the KV cache: failing it", head.request_id)
        return [self.abort_group(head, "kv cache: the request needs more blocks than the whole pool",
                                 FailureKind.NO_ROOM)]

    def _waiting_for_remote_kv(self) -> bool:
        return any(g.live and g.live[0].status == RequestStatus.WAITING_FOR_REMOTE_KV for g in self.groups.values())

    def check_integrity(self) -> None:
        """Every live sequence is known and queued; no sequence is known twice."""
        for group in self.groups.values():
            for seq in group.live:
                if self._seq_group.get(seq.request_id) is not group:
                    raise RuntimeError(f"engine: {seq.request_id} is live but not tracked")
                if seq.status.finished:
                    raise RuntimeError(f"engine: {seq.request_id} is live with status {seq.status.value}")
        live = sum(len(g.live) for g in self.groups.values())
        if live != len(self._seq_group):
            raise RuntimeError(f"engine: {len(self._seq_group)} sequences tracked, {live} live")
        if self.speculator is not None:
            self.speculator.check_integrity(self._seq_group.keys())
        if self.structured is not None:
            self.structured.check_integrity(set(self._seq_group))
        stray = [g for g in self._on_ready if g not in self.groups]
        if stray:
            raise RuntimeError(f"engine: {stray[:4]} wait for a grammar but are not running")


def _running(seq: Request) -> bool:
    return seq.status == RequestStatus.RUNNING


def _decoding_only(scheduled: Scheduled) -> bool:
    """A batch of decoding sequences alone: only such steps time speculation's payoff (a
    prompt's prefill in the batch would weigh on whichever mode it fell in)."""
    return bool(scheduled) and all(
        r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1 for r, _ in scheduled)

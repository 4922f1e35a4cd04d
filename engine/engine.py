"""The loop every worker runs: add_request / step / abort.

    add_request -> waiting --schedule--> running --finish--> FINISHED (blocks freed)
                               ^            |
                               +--preempt---+

A request is a group of sequences: one, n parallel samples (forked from the
prompt's KV after its prefill), or k beams (forked every step). Forks share full
blocks by reference and copy the partial last block.
"""

from __future__ import annotations

from collections.abc import Callable
import time
from dataclasses import dataclass

import torch

from pdserve.engine.beam import BeamSearch
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig, parse_dtype
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.group import SequenceGroup
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.model_runner import BatchItem, ModelRunner, kv_bytes_per_block
from pdserve.engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tokenizer import Tokenizer, has_tokenizer

DEFAULT_CPU_KV_BYTES = 1 << 30


class NoCapacityError(RuntimeError):
    """Not enough free KV blocks to reserve for a remote prefill right now."""


@dataclass(frozen=True)
class Reservation:
    """Decode side: where a prompt's KV must land, and how much of it is already here."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens whose KV this worker already holds (whole blocks)


@dataclass(frozen=True)
class ExportSlice:
    """Prefill side: KV of tokens [start, end) of an exported request was just written."""

    request_id: str
    start: int
    end: int
    block_ids: list[int]


LayerHook = Callable[[int, list[ExportSlice]], None]


@dataclass(frozen=True)
class TokenDelta:
    """One token just appended to a sequence, for streaming (see `LLMEngine.token_hook`).

    Told for every sampled token of plain and parallel-sampled requests, in the order
    they are appended (a preempted sequence recomputes its KV but never re-emits).
    Beam search emits none: beams reorder until the end, so its tokens are only final
    in the `RequestOutput` that `step()` returns."""

    request_id: str  # the request given to add_request (not the forked sequence's id)
    index: int  # which of the request's parallel samples
    token_id: int
    logprob: float | None  # of the chosen token; None when not computed here (commit_remote)
    top_logprobs: dict[int, float] | None  # when the request asked for logprobs
    finish_reason: str | None  # "stop" / "length" when this token ended the sequence


TokenHook = Callable[[TokenDelta], None]


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    max_n: int = 64  # upper bound for n and beam_width


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        dtype = parse_dtype(config.dtype)
        device = torch.device(config.device)
        sched = config.scheduler
        self.max_model_len = sched.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}"
            )
        block_size = config.cache.block_size
        self.runner = ModelRunner(
            config.model, self.model_config, dtype, device, block_size, self.max_model_len, config.attention_backend,
        )
        # Sized after the weights are loaded, so a GPU budget counts what is left.
        num_blocks = self._num_blocks(dtype, device)
        self.runner.allocate_kv_cache(num_blocks)
        self.pool = BlockPool(num_blocks, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, block_size)
        self.scheduler = Scheduler(sched, self.kv)
        self.sampler = Sampler(config.seed)
        self.tokenizer = Tokenizer(config.model) if has_tokenizer(config.model) else None
        self.groups: dict[str, SequenceGroup] = {}
        self._seq_group: dict[str, SequenceGroup] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Prefill role: finished requests whose blocks wait to be shipped, and the
        # hook told after each layer which exported tokens it has written.
        self.held: dict[str, Request] = {}
        self.layer_hook: LayerHook | None = None
        # Streaming: told each new token of a non-beam sequence, inside step() and
        # commit_remote(), on the caller's thread, before step() returns.
        self.token_hook: TokenHook | None = None
        # (sequences, tokens) the last step() ran: for batch-size metrics.
        self.last_batch: tuple[int, int] = (0, 0)

    def _num_blocks(self, dtype: torch.dtype, device: torch.device) -> int:
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = kv_bytes_per_block(self.model_config, cache.block_size, dtype)
        budget = cache.memory_bytes
        if budget is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * self.config.gpu_memory_utilization)
        budget = budget or DEFAULT_CPU_KV_BYTES
        # Never more than every sequence at full length could use.
        most = sched.max_num_seqs * -(-self.max_model_len // cache.block_size)
        num = min(budget // per_block, most)
        if num < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes holds no block of {per_block} bytes")
        return int(num)

    # -- requests ---------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, export_kv: bool = False
    ) -> None:
        """Queue a request. With `export_kv` (prefill role) its blocks outlive it until
        `release(request_id)`, so the KV can be shipped to a decode worker."""
        request = self._new_group(request_id, prompt_token_ids, params)
        request.export_kv = export_kv
        self.scheduler.add(request)

    def _new_group(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self.groups or request_id in self.held:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self._validate(prompt_token_ids, params)
        request = Request(
            request_id, list(prompt_token_ids), params, self.config.cache.block_size,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        beam = None
        if params.use_beam_search:
            beam = BeamSearch(params, len(prompt_token_ids), () if params.ignore_eos else self.model_config.eos_token_ids)
        group = SequenceGroup(request_id, params, list(prompt_token_ids), [request], beam=beam)
        self.groups[request_id] = group
        self._track(request, group)
        return request

    # -- disaggregation: decode side ----------------------------------------------

    def reserve_remote(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Reservation:
        """Allocate blocks for a prompt whose KV a prefill worker will send. The
        request waits (WAITING_FOR_REMOTE_KV, never scheduled) until `commit_remote`
        or `abort`; the caller owns its deadline. Raises NoCapacityError when full."""
        request = self._new_group(request_id, prompt_token_ids, params)
        hits, num_hit = self.kv.get_computed_blocks(request)
        if not self.kv.allocate_slots(request, request.num_tokens - num_hit, hits):
            self._drop_group(request_id)
            raise NoCapacityError(f"kv cache: no room for {request.num_tokens} tokens of {request_id!r}")
        request.num_cached_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return Reservation(request_id, self.kv.block_ids(request_id), num_hit)

    def commit_remote(self, request_id: str, first_token: int | None = None) -> list[RequestOutput]:
        """The reserved blocks now hold the prompt's KV: start decoding. With
        `first_token` (sampled by the prefill worker) decoding continues from it;
        without (n > 1, beams) this worker recomputes the last prompt token and samples
        itself. Returns the request's output if that token already finished it."""
        group = self.groups.get(request_id)
        if group is None or group.live[0].status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request_id: {request_id!r} has no reservation waiting for KV")
        request = group.live[0]
        request.kv_committed_time = request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = request.num_prompt_tokens - (first_token is None)
        self.kv.cache_full_blocks(request)
        self.scheduler.adopt(request)
        if first_token is None:
            return []
        finished: list[RequestOutput] = []
        self._apply_tokens(request, first_token, None, None, finished)
        return finished

    def _drop_group(self, request_id: str) -> None:
        group = self.groups.pop(request_id)
        for seq in group.live:
            self._seq_group.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
            self.kv.free(seq.request_id)

    # -- disaggregation: prefill side ---------------------------------------------

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished exported request (its KV has been shipped, or
        its lease ran out)."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request_id)

    def held_block_ids(self, request_id: str) -> list[int]:
        if request_id not in self.held:
            raise ValueError(f"request_id: {request_id!r} holds no exported blocks")
        return self.kv.block_ids(request_id)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        max_len = self.max_model_len
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        if len(prompt) + params.max_tokens > max_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len {max_len}"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token {bad} outside the vocabulary [0, {vocab})")
        if max(params.n, params.beam_width) > self.config.max_n:
            raise ValueError(f"n: n and beam_width must be <= {self.config.max_n}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (idempotent)."""
        self.release(request_id)
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in list(group.live):
            self._finish_seq(group, seq, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # -- the loop ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of finished requests."""
        plan = self.scheduler.schedule()
        self.last_batch = (len(plan.scheduled), plan.num_tokens)
        if not plan.scheduled:
            return self._fail_unschedulable(plan.preempted)
        batch = [BatchItem(r, n, self.kv.block_ids(r.request_id)) for r, n in plan.scheduled]
        logits, spans = self.runner.execute(batch, self._layer_callback(plan.scheduled))
        seqs, logit_rows, beams = [], [], []
        for (request, n), (first, num_rows) in zip(plan.scheduled, spans):
            if request.sampling_params.prompt_logprobs is not None and request.num_computed_tokens < request.num_prompt_tokens:
                self._record_prompt_logprobs(request, logits[first : first + num_rows])
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)
            if num_rows == 0 or request.num_computed_tokens < request.num_tokens:
                continue
            row = first + num_rows - 1
            group = self._seq_group[request.request_id]
            if group.beam is not None:
                beams.append((group, request, logits[row]))
                continue
            for seq in self._fan_out(group, request):
                seqs.append(seq)
                logit_rows.append(row)
        finished: list[RequestOutput] = []
        if seqs:
            self._apply_samples(seqs, logits[logit_rows], finished)
        for group, request, row_logits in beams:
            self._beam_step(group, request, row_logits, finished)
        return finished

    def _layer_callback(self, scheduled: list[tuple[Request, int]]) -> Callable[[int], None] | None:
        hook = self.layer_hook
        if hook is None:
            return None
        slices = [
            ExportSlice(r.request_id, r.num_computed_tokens, r.num_computed_tokens + n, self.kv.block_ids(r.request_id))
            for r, n in scheduled
            if r.export_kv
        ]
        if not slices:
            return None
        return lambda layer: hook(layer, slices)

    def _record_prompt_logprobs(self, request: Request, logits: torch.Tensor) -> None:
        """Row j scores the token after position num_computed + j, while it is a prompt token."""
        start = request.num_computed_tokens
        if start == 0:
            request.prompt_logprobs = [None]
        k = request.sampling_params.prompt_logprobs or 0
        logprobs = torch.log_softmax(logits, dim=-1)
        for j in range(logits.shape[0]):
            nxt = start + j + 1
            if nxt >= request.num_prompt_tokens or len(request.prompt_logprobs) > nxt:
                continue
            token = request.token_ids[nxt]
            values, ids = logprobs[j].topk(k)
            top = dict(zip(ids.tolist(), values.tolist()))
            request.prompt_logprobs.append({**top, token: float(logprobs[j, token])})

    def _fan_out(self, group: SequenceGroup, parent: Request) -> list[Request]:
        """After the prompt's prefill, fork the n - 1 other samples off its KV."""
        if not group.needs_fan_out:
            return [parent]
        group.fanned_out = True
        out = [parent]
        for index in range(1, group.params.n):
            child = parent.fork(group.child_id(), index)
            copies = self.kv.fork(parent, child)
            self._track(child, group)
            group.live.append(child)
            if copies is None:  # no block for the copy: recompute it later (prefix cache hits)
                child.num_computed_tokens = 0
                self.scheduler.add(child)
                continue
            self.runner.copy_blocks(copies)
            self.scheduler.adopt(child)
            out.append(child)
        return out

    def _apply_samples(self, seqs: list[Request], logits: torch.Tensor, finished: list[RequestOutput]) -> None:
        result = self.sampler(logits, seqs)
        for i, seq in enumerate(seqs):
            self._apply_tokens(seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i], finished)

    def _apply_tokens(
        self, seq: Request, token: int, logprob: float | None, top: dict[int, float] | None, finished: list[RequestOutput]
    ) -> None:
        seq.append_token(token)
        seq.first_token_time = seq.first_token_time or time.monotonic()
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if top is not None:
            seq.logprobs.append({**top, token: logprob})
        new_text = self._detokenize(seq)
        status = seq.check_stop() or self._check_stop_strings(seq, new_text)
        group = self._seq_group[seq.request_id]
        if self.token_hook is not None:
            self.token_hook(TokenDelta(
                group.request_id, seq.sample_index, token, logprob, top, status.value if status else None,
            ))
        if status is not None:
            self._finish_seq(group, seq, status)
            self._maybe_finish_group(group, finished)

    def _detokenize(self, seq: Request) -> str:
        detok = self._detok.get(seq.request_id)
        if detok is None:
            return ""
        new = detok.append(seq.token_ids[-1])
        seq.text = detok.text
        return new

    def _check_stop_strings(self, seq: Request, new: str) -> RequestStatus | None:
        """Stop strings are matched on the text, so they may span tokens; the match
        and everything after it is cut from the output."""
        if not new or not seq.sampling_params.stop:
            return None
        window = len(new) + max(len(s) for s in seq.sampling_params.stop)
        start = max(0, len(seq.text) - window)
        hits = [seq.text.find(s, start) for s in seq.sampling_params.stop]
        hits = [h for h in hits if h >= 0]
        if not hits:
            return None
        seq.text = seq.text[: min(hits)]
        return RequestStatus.FINISHED_STOPPED

    def _beam_step(self, group: SequenceGroup, seq: Request, logits: torch.Tensor, finished: list[RequestOutput]) -> None:
        group.pending[seq.request_id] = torch.log_softmax(logits.float(), dim=-1)
        if len(group.pending) < len(group.live):
            return  # siblings not stepped yet (not scheduled or preempted)
        beams = list(group.live)
        log_probs = torch.stack([group.pending[b.request_id] for b in beams])
        group.pending.clear()
        if seq.num_output_tokens < group.params.min_tokens:
            log_probs[:, list(group.beam.eos_token_ids)] = float("-inf")
        step = group.beam.step(log_probs, [b.output_token_ids for b in beams])
        if step.done:
            for b in beams:
                self._finish_seq(group, b, RequestStatus.FINISHED_STOPPED)
            self._maybe_finish_group(group, finished)
            return
        self._reform_beams(group, beams, step.continuations)

    def _reform_beams(self, group: SequenceGroup, beams: list[Request], continuations: list[tuple[int, int]]) -> None:
        """Fork the surviving beams' block tables for the next step; free the dropped."""
        reused: set[int] = set()
        new_live: list[Request] = []
        for parent_index, token in continuations:
            parent = beams[parent_index]
            if parent_index not in reused:
                reused.add(parent_index)
                child = parent
            else:
                child = parent.fork(group.child_id(), parent.sample_index)
                copies = self.kv.fork(parent, child)
                self._track(child, group)
                if copies is None:
                    child.num_computed_tokens = 0
                    self.scheduler.add(child)
                else:
                    self.runner.copy_blocks(copies)
                    self.scheduler.adopt(child)
            new_live.append(child)
        for index, beam in enumerate(beams):
            if index not in reused:
                self._finish_seq(group, beam, RequestStatus.FINISHED_ABORTED, keep=False)
        group.live = new_live
        now = time.monotonic()
        for child, (_, token) in zip(new_live, continuations):
            child.append_token(token)
            child.first_token_time = child.first_token_time or now

    def _track(self, seq: Request, group: SequenceGroup) -> None:
        self._seq_group[seq.request_id] = group
        if self.tokenizer is not None and group.beam is None:
            self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
            if seq.output_token_ids:
                for t in seq.output_token_ids:
                    self._detok[seq.request_id].append(t)

    def _finish_seq(self, group: SequenceGroup, seq: Request, status: RequestStatus, keep: bool = True) -> None:
        hold = seq.export_kv and status != RequestStatus.FINISHED_ABORTED
        self.scheduler.finish(seq, status, free=not hold)
        if hold:
            self.held[seq.request_id] = seq
        self._seq_group.pop(seq.request_id, None)
        detok = self._detok.pop(seq.request_id, None)
        if detok is not None and status != RequestStatus.FINISHED_STOPPED:
            seq.text = detok.text + detok.flush()
        if seq in group.live:
            group.live.remove(seq)
        if keep:
            group.finished.append(seq)

    def _maybe_finish_group(self, group: SequenceGroup, finished: list[RequestOutput]) -> None:
        if group.done and self.groups.pop(group.request_id, None) is not None:
            finished.append(self._output(group))

    def _fail_unschedulable(self, just_preempted: list[Request]) -> list[RequestOutput]:
        """Nothing could run this step. If nothing will free blocks by itself either (no
        running sequence has work: at most beams waiting on a sibling; no KV held for
        shipping or reserved for a remote prefill, which deadlines free), the head of the
        queue can never fit: fail its request instead of spinning forever."""
        if just_preempted or not self.scheduler.waiting or self.held:
            return []
        if any(r.num_computed_tokens < r.num_tokens for r in self.scheduler.running):
            return []
        if any(g.live and g.live[0].status == RequestStatus.WAITING_FOR_REMOTE_KV for g in self.groups.values()):
            return []
        seq = self.scheduler.waiting[0]
        group = self._seq_group[seq.request_id]
        for s in list(group.live):
            self._finish_seq(group, s, RequestStatus.FINISHED_ABORTED)
        finished: list[RequestOutput] = []
        self._maybe_finish_group(group, finished)
        return finished

    def _output(self, group: SequenceGroup) -> RequestOutput:
        if group.beam is not None and group.beam.results(group.params.n):
            completions = [
                CompletionOutput(i, h.token_ids, self._decode(h.token_ids), "stop" if h.token_ids[-1] in group.beam.eos_token_ids else "length", h.sum_logprob)
                for i, h in enumerate(group.beam.results(group.params.n))
            ]
        else:
            seqs = sorted(group.finished, key=lambda s: s.sample_index)
            completions = [
                CompletionOutput(
                    s.sample_index, s.output_token_ids, s.text, s.status.value, s.cumulative_logprob,
                    s.logprobs if s.sampling_params.logprobs is not None else None,
                )
                for s in seqs
            ]
        first = group.finished[0] if group.finished else None
        return RequestOutput(
            group.request_id, None, group.prompt_token_ids, completions, finished=True,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            prompt_logprobs=first.prompt_logprobs if first and group.params.prompt_logprobs is not None else None,
            times=_times(group.finished),
        )

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    # -- introspection ----------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        return {
            "num_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_blocks": self.pool.num_cached_blocks,
            "kv_cache_usage": self.pool.usage(),
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_requests_held": len(self.held),
            "num_held_blocks": sum(len(self.kv.req_blocks.get(rid, ())) for rid in self.held),
        }

    def has_scheduled_work(self) -> bool:
        """Whether `step()` has anything to run (reservations waiting for remote KV and
        held exported blocks do not count: they only change through calls)."""
        return self.scheduler.num_unfinished > 0

    def cached_block_hashes(self) -> list[bytes]:
        """Hashes of the blocks whose KV this worker's prefix cache holds right now."""
        return [b.block_hash for b in self.pool.blocks if b.block_hash is not None]

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for request in self.scheduler.running:
            have = len(self.kv.req_blocks.get(request.request_id, ()))
            need = -(-request.num_computed_tokens // self.config.cache.block_size)
            if have < need:
                raise RuntimeError(f"engine: {request.request_id} has {have} blocks for {need} computed")


def _times(seqs: list[Request]) -> RequestTimes:
    """A request's phases from its sequences (forks inherit their parent's times)."""

    def earliest(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return min(present) if present else None

    return RequestTimes(
        arrival=min((s.arrival_time for s in seqs), default=time.monotonic()),
        scheduled=earliest([s.first_scheduled_time for s in seqs]),
        first_token=earliest([s.first_token_time for s in seqs]),
        finished=time.monotonic(),
        kv_committed=earliest([s.kv_committed_time for s in seqs]),
    )

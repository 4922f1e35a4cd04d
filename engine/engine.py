"""The engine every worker runs: add_request / step / abort.

    add_request -> waiting --schedule--> running --finish--> FINISHED (blocks freed)
                               ^            |
                               +--preempt---+

A request is a group of sequences: one, n parallel samples (forked from the
prompt's KV after its prefill), or k beams (forked every step). Forks share full
blocks by reference and copy the partial last block.

`LLMEngine` builds the parts and is their public face; each seam has its own file:

    validation.py   input processing: what a request must pass to enter (shared with the router)
    core.py         stepping: schedule, forward, sample, failure isolation, stalls
    output.py       output processing: tokens, stop decisions (text.py: stop strings), outputs
    forking.py      fan-out of n samples, beams' forks
    disagg.py       disaggregation hooks: reservations, commits, held blocks, layer hook
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Sequence

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig, ModelConfig, resolve_dtype
from pdserve.engine.core import EngineCore
from pdserve.engine.disagg import NoCapacityError, RemoteKV, Reservation
from pdserve.engine.export import ExportSlice, LayerHook
from pdserve.engine.group import SequenceGroup
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_events import KvEventLog
from pdserve.engine import memory
from pdserve.engine.memory import MemoryPlan
from pdserve.engine.model_runner import BatchItem, ModelRunner, kv_bytes_per_block
from pdserve.engine.offload.build import build_tiers
from pdserve.engine.offload.stats import OffloadStats
from pdserve.engine.offload.tiers import LowerTiers
from pdserve.engine.output import OutputProcessor, TokenDelta, TokenHook
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams, continues_from_first_token
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.quant.apply import weight_bytes
from pdserve.engine.spec.draft_model import DraftModelProposer, check_draft_model
from pdserve.engine.spec.draft_state import DraftLayout, DraftState
from pdserve.engine.spec.eagle import EagleProposer
from pdserve.engine.spec.eagle_head import KINDS as EAGLE_KINDS
from pdserve.engine.spec.eagle_head import EagleHead, load_head, read_spec
from pdserve.engine.spec.speculator import NgramProposer, Proposer, SpecStats, Speculator
from pdserve.engine.stats import EngineStats
from pdserve.engine.structured.build import build_structured
from pdserve.engine.structured.compiler import StructuredStats
from pdserve.engine.tokenizer import Tokenizer, has_tokenizer
from pdserve.engine.validation import SamplingLimits, validate_prompt, validate_sampling_params


log = logging.getLogger(__name__)

__all__ = [
    "EngineConfig", "ExportSlice", "LLMEngine", "LayerHook", "NoCapacityError", "Reservation", "TokenDelta",
    "TokenHook",
]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        device = torch.device(config.device)
        dtype, why = resolve_dtype(config.dtype, device, self.model_config.checkpoint_dtype)
        log.info("dtype: %s (%s)", str(dtype).removeprefix("torch."), why)
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
            config.quantization, config.kv_cache_dtype, prepack=not config.enforce_eager,
            capture_sizes=() if config.enforce_eager else config.decode_capture_sizes,
        )
        self._log_compute(device)
        self.draft_runner = self._draft_runner(dtype, device)
        self.eagle_head = self._eagle_head(dtype, device)
        # Sized after the weights are loaded, so a GPU budget counts what is left.
        self.memory = self._plan_memory(dtype, device)
        num_blocks = self.memory.num_blocks
        self.runner.allocate_kv_cache(num_blocks)
        self.speculator = self._speculator(num_blocks)
        self.offload = self._offload()
        self.pool = BlockPool(num_blocks, config.cache.enable_prefix_caching, observer=self.offload)
        if self.offload is not None:  # KV events name the tier a block sits in
            self.offload.watch(self.pool.events.tier_changed)
        self.kv = KVCacheManager(self.pool, block_size, lower=self.offload)
        self.scheduler = Scheduler(sched, self.kv)
        self.sampler = Sampler(config.seed)
        self.tokenizer = Tokenizer(config.model) if has_tokenizer(config.model) else None
        self.limits = SamplingLimits(
            self.model_config.vocab_size, max_n=config.max_n, max_logprobs=config.max_logprobs,
            has_tokenizer=self.tokenizer is not None, max_num_seqs=sched.max_num_seqs,
        )
        self.output = OutputProcessor(self.tokenizer)
        self.structured = build_structured(config, self.model_config.vocab_size, self.model_config.eos_token_ids)
        if self.structured is not None:
            weakref.finalize(self, self.structured.compiler.close)
        self.core = EngineCore(
            self.runner, self.kv, self.scheduler, self.sampler, self.output, self.model_config.eos_token_ids,
            self.speculator, self.structured,
        )
        self.remote = RemoteKV(self.core)

    def _log_compute(self, device: torch.device) -> None:
        """Say which cores the engine computes on (--torch-threads, the CPU affinity) and
        whether the fast path is on: a benchmark's figures mean nothing without them."""
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        runner = self.runner
        path = "eager (enforce_eager)" if self.config.enforce_eager else (
            f"fast: decode step captured for batch sizes {list(runner.captured.sizes)}" if runner.captured
            else f"fast: {runner.prepacked} linear layers prepacked for oneDNN" if runner.prepacked
            else "fast: nothing to prepack here")
        log.info("engine on %s: %d torch threads, %s CPUs allowed; %s", device, torch.get_num_threads(), allowed, path)

    def _offload(self) -> LowerTiers | None:
        """The tiers below the device pool (engine/offload/), or None. Not with a draft
        model or an EAGLE head: their KV pools are not offloaded, so a block copied up
        would pair the target's KV with a stale draft's."""
        config = self.config
        if not config.kv_offload:
            return None
        if self.draft_runner is not None or self.eagle_head is not None:
            raise ValueError("kv_offload_host_bytes, kv_offload_dir: the KV tiers do not hold a draft model's or "
                             "EAGLE head's KV; use them without speculative decoding, or with the ngram method")
        tiers = build_tiers(config, self.runner.kv_cache, self.kv_format)
        if tiers is not None:
            weakref.finalize(self, tiers.close)  # the worker thread ends with the engine
            host = tiers.host.num_slots * tiers.layout.block_bytes if tiers.host is not None else 0
            self.memory = dataclasses.replace(self.memory, host_tier_bytes=host,
                                              disk_tier_bytes=config.kv_offload_disk_bytes if tiers.disk else 0)
        return tiers

    def close(self) -> None:
        """Stop the tiers' worker (queued copies down are dropped; with a persistent
        disk tier the host tier's blocks are written to disk first) and the grammar
        compiler's pool (compiles not started are dropped); idempotent. The
        engine must not step afterwards."""
        if self.offload is not None:
            self.offload.close()
        if self.structured is not None:
            self.structured.compiler.close()

    def _plan_memory(self, dtype: torch.dtype, device: torch.device) -> MemoryPlan:
        """Weights as loaded, the activation peak (measured on a GPU), the KV budget and blocks."""
        cache, sched = self.config.cache, self.config.scheduler
        cfg, runner = self.model_config, self.runner
        per_token = memory.kv_bytes_per_token(cfg, runner.kv_dtype)
        per_block = per_token * cache.block_size
        if self.draft_runner is not None:  # the draft's pool has as many blocks
            per_block += kv_bytes_per_block(self.draft_runner.cfg, cache.block_size, self.draft_runner.kv_dtype)
        weights = runner.weight_bytes + (self.draft_runner.weight_bytes if self.draft_runner else 0)
        if self.eagle_head is not None:  # so has the head's (one layer)
            head_cfg = self.eagle_head.spec.cfg
            per_block += 2 * cache.block_size * head_cfg.num_kv_heads * head_cfg.head_dim * dtype.itemsize
            weights += weight_bytes(self.eagle_head)
        device_memory = None
        if device.type == "cuda":
            activations = self._measure_activation_peak(device)
            device_memory = torch.cuda.mem_get_info(device)[1]
        else:
            activations = memory.activation_estimate(cfg, sched.max_num_batched_tokens, sched.max_num_seqs, dtype)
        budget = memory.kv_budget(
            num_blocks=cache.num_blocks, kv_cache_memory=cache.memory_bytes, device_memory=device_memory,
            gpu_memory_utilization=self.config.gpu_memory_utilization, weight_bytes=weights,
            activation_bytes=activations, per_block=per_block)
        blocks = memory.count_blocks(budget, cache.num_blocks, per_block, sched.max_num_seqs, self.max_model_len,
                                     cache.block_size)
        return MemoryPlan(weights, runner.weight_scheme, activations, str(runner.kv_dtype).removeprefix("torch."),
                          per_block // cache.block_size, per_block, blocks * per_block, blocks, cache.block_size,
                          self.max_model_len)

    def _measure_activation_peak(self, device: torch.device) -> int:
        """The memory one forward of a full token budget takes beyond the weights (vLLM's
        profile run), with a KV cache of one block per sequence so attention runs."""
        sched, bs = self.config.scheduler, self.config.cache.block_size
        tokens = min(sched.max_num_batched_tokens, self.max_model_len)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        self.runner.allocate_kv_cache(-(-tokens // bs))
        kv_bytes = torch.cuda.memory_allocated(device) - before
        probe = _ProfileSequence(tokens)
        self.runner.execute([BatchItem(probe, tokens, list(range(-(-tokens // bs))))])
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before - kv_bytes
        self.runner.allocate_kv_cache(0)
        torch.cuda.empty_cache()
        return int(peak)

    def _draft_runner(self, dtype: torch.dtype, device: torch.device) -> ModelRunner | None:
        """The draft model of `speculative_config` (method draft_model), checked against the target."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        draft_config = ModelConfig.from_dir(spec.model)
        check_draft_model(self.config.model, self.model_config, spec.model, draft_config, self.max_model_len)
        return ModelRunner(spec.model, draft_config, dtype, device, self.config.cache.block_size,
                           self.max_model_len, self.config.attention_backend, prepack=not self.config.enforce_eager)

    def _eagle_head(self, dtype: torch.dtype, device: torch.device) -> EagleHead | None:
        """The EAGLE head of `speculative_config` (methods eagle, eagle3), checked against the target."""
        spec = self.config.speculative
        if spec is None or spec.method not in EAGLE_KINDS:
            return None
        head_spec = read_spec(spec.method, spec.model, self.model_config)
        return load_head(head_spec, spec.model, dtype, device, self.max_model_len)

    def _speculator(self, num_blocks: int) -> Speculator | None:
        spec = self.config.speculative
        if spec is None:
            return None
        proposer: Proposer
        if self.eagle_head is not None:
            model = self.runner.model
            proposer = EagleProposer(self.eagle_head, self.runner.backend, model.embed_tokens, model.logits,
                                     num_blocks, self.config.cache.block_size, self.runner.dtype, self.runner.device)
        elif self.draft_runner is not None:
            proposer = DraftModelProposer(self.draft_runner, num_blocks)
        else:
            # SpeculativeConfig sets both bounds for ngram
            proposer = NgramProposer(int(spec.prompt_lookup_min or 0), int(spec.prompt_lookup_max or 0))
        return Speculator(spec, proposer, self.max_model_len)

    # -- state the services read or hook into ---------------------------------------------

    @property
    def groups(self) -> dict[str, SequenceGroup]:
        return self.core.groups

    @property
    def held(self) -> dict[str, Request]:
        """Prefill role: finished exported requests whose blocks wait to be shipped."""
        return self.core.held

    @property
    def layer_hook(self) -> LayerHook | None:
        """Told after each layer which exported tokens it has written (prefill role)."""
        return self.core.layer_hook

    @layer_hook.setter
    def layer_hook(self, hook: LayerHook | None) -> None:
        self.core.layer_hook = hook

    @property
    def token_hook(self) -> TokenHook | None:
        """Streaming: told each new token of a non-beam sequence, inside step() and
        commit_remote(), on the caller's thread, before step() returns."""
        return self.output.token_hook

    @token_hook.setter
    def token_hook(self, hook: TokenHook | None) -> None:
        self.output.token_hook = hook

    # -- requests -----------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if this engine cannot serve the request."""
        validate_prompt(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        validate_sampling_params(params, self.limits)
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs: this model has no tokenizer.json to compile grammars for")
            self.structured.check(params.structured_outputs)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, export_kv: bool = False,
        first_token: int | None = None, block_hashes: Sequence[bytes] = (),
    ) -> list[RequestOutput]:
        """Queue a request. With `export_kv` (prefill role) its blocks outlive it until
        `release(request_id)`, so the KV can be shipped to a decode worker.

        With `first_token` (`continues_from_first_token`: n == 1, no beams): that
        token, sampled elsewhere, is the request's first output token (told to the
        token hook at once, as a committed transfer's is; with structured_outputs, once
        its grammar has compiled: it enters the matcher first), and the prompt is computed
        with it, as a preempted sequence is recomputed, before the next token is
        sampled: a decode worker taking over a prompt whose KV never arrived. Returns
        the request's output if that token already finished it (else []).

        `block_hashes`: the prompt's full blocks' hashes (engine/hashing.py), computed
        and checked by the caller (`checked_block_hashes`); none: hashed here."""
        self.validate(prompt_token_ids, params)
        if first_token is not None:
            if not continues_from_first_token(params):
                raise ValueError("first_token: only for n == 1 without beam search")
            if not 0 <= first_token < self.model_config.vocab_size:
                raise ValueError(f"first_token: {first_token} is not in [0, {self.model_config.vocab_size})")
        request = self.core.new_group(request_id, prompt_token_ids, params, block_hashes)
        request.export_kv = export_kv
        group = self.core.groups[request_id]
        finished: list[RequestOutput] = []

        def admit(finished: list[RequestOutput]) -> None:
            if first_token is not None:
                before = len(finished)
                self.core.apply_token(group, request, first_token, None, None, finished)
                if len(finished) > before:
                    return
            self.scheduler.add(request)

        self.core.when_ready(group, admit, finished)  # a constrained request: once its grammar compiled
        return finished

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks (idempotent); its output
        so far (for beam search: the n best of finished and running beams, best first)."""
        self.remote.release(request_id)
        group = self.core.groups.get(request_id)
        return None if group is None else self.core.abort_group(group)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of finished requests."""
        return self.core.step()

    def has_unfinished(self) -> bool:
        return bool(self.core.groups)

    # -- disaggregation -----------------------------------------------------------------

    def reserve_remote(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_hashes: Sequence[bytes] = (),
    ) -> Reservation:
        """Allocate blocks for a prompt whose KV a prefill worker will send. The
        request waits (WAITING_FOR_REMOTE_KV, never scheduled) until `commit_remote`
        or `abort`; the caller owns its deadline. Raises NoCapacityError when full.
        `block_hashes`: as in add_request; the reservation carries the prompt's."""
        self.validate(prompt_token_ids, params)
        return self.remote.reserve(request_id, prompt_token_ids, params, block_hashes)

    def commit_remote(self, request_id: str, first_token: int | None = None,
                      draft: DraftState | None = None) -> list[RequestOutput]:
        """The reserved blocks now hold the prompt's KV: start decoding. With
        `first_token` (sampled by the prefill worker) decoding continues from it;
        without (n > 1, beams) this worker recomputes the last prompt token and samples
        itself. `draft`: the prefill worker's EAGLE head state for the prompt. Returns
        the request's output if that token already finished it."""
        return self.remote.commit(request_id, first_token, draft)

    def held_draft(self, request_id: str) -> DraftState | None:
        """Prefill side: the EAGLE head's state at the end of a held prompt, to ship."""
        return self.remote.held_draft(request_id)

    @property
    def draft_layout(self) -> DraftLayout | None:
        """Decode side: the EAGLE head state this engine takes with a prompt's KV."""
        return self.speculator.draft_layout if self.speculator is not None else None

    @property
    def kv_format(self) -> str:
        """The runner's kv_format, and the EAGLE head's digest: a prefill worker's head
        fills its decode worker's, so workers with different heads do not pair."""
        text = self.runner.kv_format
        return text if self.eagle_head is None else f"{text};eagle_head={self.eagle_head.digest}"

    @property
    def kv_layout(self) -> str:
        """What two workers exchanging KV (and head state) must share (WorkerInfo.kv_layout)."""
        return f"{str(self.runner.kv_dtype).removeprefix('torch.')};{self.kv_format}"

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished exported request (its KV has been shipped, or
        its lease ran out)."""
        self.remote.release(request_id)

    def held_block_ids(self, request_id: str) -> list[int]:
        return self.remote.held_block_ids(request_id)

    # -- introspection ------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            kv_cache_usage=self.pool.usage(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_requests_held=len(self.core.held),
            num_held_blocks=sum(len(self.kv.req_blocks.get(rid, ())) for rid in self.core.held),
            spec_decode=self.speculator.stats() if self.speculator is not None else SpecStats(),
            kv_fragmentation=self.kv.fragmentation(),
            kv_offload=self.offload.stats() if self.offload is not None else OffloadStats(),
            structured_outputs=self.structured.stats() if self.structured is not None else StructuredStats(),
        )

    def structured_compile_times(self) -> list[float]:
        """Seconds of each grammar compile since the last call (the compile-time histogram)."""
        return self.structured.compiler.take_compile_times() if self.structured is not None else []

    @property
    def last_batch(self) -> tuple[int, int]:
        """(sequences, tokens) the last step() ran: for batch-size metrics."""
        return self.core.last_batch

    @property
    def last_scheduled(self) -> tuple[str, ...]:
        """Request ids in the last step's batch (empty before its schedule is made)."""
        return self.core.last_scheduled

    def has_scheduled_work(self) -> bool:
        """Whether `step()` has anything to run (reservations waiting for remote KV and
        held exported blocks do not count: they only change through calls; grammars being
        compiled do: step() polls them)."""
        return self.scheduler.num_unfinished > 0 or (self.structured is not None and self.structured.num_pending > 0)

    def prefix_tiers(self, prompt_token_ids: Sequence[int], block_hashes: Sequence[bytes] = (),
                     cache_salt: str | None = None) -> list[str]:
        """The tier of each block of the longest cached prefix of a prompt ("device",
        "host", "disk"; as a lookup at admission would find it, the last prompt token
        left to compute); nothing is moved or counted. `block_hashes`: the prompt's,
        if the caller has them (else hashed here)."""
        hashes = block_hashes or hash_blocks(prompt_token_ids, self.config.cache.block_size, cache_salt=cache_salt)
        return self.kv.prefix_tiers(hashes, prompt_token_ids)

    def cached_block_hashes(self) -> list[bytes]:
        """Hashes of the blocks whose KV this worker's prefix cache holds right now."""
        return [b.block_hash for b in self.pool.blocks if b.block_hash is not None]

    @property
    def kv_events(self) -> KvEventLog:
        """The prefix cache's stored / removed hashes as numbered batches
        (engine/kv_events.py): whoever owns the engine thread calls `flush()` after
        each step or call that may have changed the cache."""
        return self.pool.events

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity(idle=False)
        self.scheduler.check_integrity()
        self.core.check_integrity()
        for request in self.scheduler.running:
            have = len(self.kv.req_blocks.get(request.request_id, ()))
            need = -(-request.num_computed_tokens // self.config.cache.block_size)
            if have < need:
                raise RuntimeError(f"engine: {request.request_id} has {have} blocks for {need} computed")


class _ProfileSequence:
    """A prompt of `n` token 0s for the activation profile run (engine.Sequence)."""

    def __init__(self, n: int) -> None:
        self.token_ids = [0] * n
        self.num_computed_tokens = 0
        self.sampling_params = SamplingParams(max_tokens=1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

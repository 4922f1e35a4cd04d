"""The loop every worker runs: add_request / step / abort.

    add_request -> waiting --schedule--> running --finish--> FINISHED (blocks freed)
                               ^            |
                               +--preempt---+
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_pool import BlockPool
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, parse_dtype
from engine.kv_cache import KVCacheManager
from engine.model_runner import BatchItem, ModelRunner, kv_bytes_per_block
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9


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
        num_blocks = self._num_blocks(dtype, device)
        self.runner = ModelRunner(
            config.model, self.model_config, dtype, device, block_size, num_blocks,
            self.max_model_len, config.attention_backend,
        )
        self.pool = BlockPool(num_blocks, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, block_size)
        self.scheduler = Scheduler(sched, self.kv)
        self.requests: dict[str, Request] = {}

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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self._validate(prompt_token_ids, params)
        request = Request(
            request_id, list(prompt_token_ids), params, self.config.cache.block_size,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

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

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the loop ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of finished requests."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return self._fail_unschedulable()
        batch = [BatchItem(r, n, self.kv.block_ids(r.request_id)) for r, n in plan.scheduled]
        logits, rows = self.runner.execute(batch)
        finished: list[RequestOutput] = []
        for request, n in plan.scheduled:
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)
        sampled = [plan.scheduled[i][0] for i in rows]
        for request, token in zip(sampled, sample(logits, sampled)):
            request.append_token(token)
            status = request.check_stop()
            if status is not None:
                self.scheduler.finish(request, status)
                del self.requests[request.request_id]
                finished.append(self._output(request))
        return finished

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing fits even in an idle pool: fail the head request instead of spinning."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        request = self.scheduler.waiting[0]
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        del self.requests[request.request_id]
        return [self._output(request)]

    def _output(self, request: Request) -> RequestOutput:
        completion = CompletionOutput(0, request.output_token_ids, finish_reason=request.status.value)
        return RequestOutput(
            request.request_id, None, request.prompt_token_ids, [completion],
            finished=True, num_cached_tokens=request.num_cached_tokens,
        )

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
        }

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for request in self.scheduler.running:
            have = len(self.kv.req_blocks.get(request.request_id, ()))
            need = -(-request.num_computed_tokens // self.config.cache.block_size)
            if have < need:
                raise RuntimeError(f"engine: {request.request_id} has {have} blocks for {need} computed")

"""The offline entry point: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from pdserve.engine.config import DEFAULT_MAX_LOGPROBS, DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.stats import EngineStats
from pdserve.engine.tokenizer import Tokenizer


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        kv_cache_memory: int | None = None,
        attention_backend: str = "auto",
        long_prefill_token_threshold: int | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        speculative_config: SpeculativeConfig | Mapping[str, object] | str | None = None,
        seed: int = 0,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        decode_capture_sizes: Sequence[int] | str = (),
        kv_offload_host_bytes: int = 0,
        kv_offload_dir: str | None = None,
        kv_offload_disk_bytes: int = 0,
        kv_offload_persist: bool = False,
        kv_offload_policy: str = "lru",
        structured_outputs_backend: str = "xgrammar",
        structured_outputs_compile_timeout: float = 10.0,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                device=device,
                cache=CacheConfig(block_size, num_blocks, kv_cache_memory, enable_prefix_caching),
                scheduler=SchedulerConfig(
                    max_num_seqs, max_num_batched_tokens, max_model_len, long_prefill_token_threshold
                ),
                attention_backend=attention_backend,
                max_logprobs=max_logprobs,
                seed=seed,
                speculative=None if speculative_config is None else SpeculativeConfig.parse(speculative_config),
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                decode_capture_sizes=decode_capture_sizes,  # type: ignore[arg-type]  # parsed by EngineConfig
                kv_offload_host_bytes=kv_offload_host_bytes, kv_offload_dir=kv_offload_dir,
                kv_offload_disk_bytes=kv_offload_disk_bytes, kv_offload_persist=kv_offload_persist,
                kv_offload_policy=kv_offload_policy,
                structured_outputs_backend=structured_outputs_backend,
                structured_outputs_compile_timeout=structured_outputs_compile_timeout,
            )
        )
        self.model_dir = model
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError(f"prompt: text given but {self.model_dir} has no tokenizer; pass token ids")
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        order: dict[str, int] = {}
        texts: list[str | None] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                text = prompt if isinstance(prompt, str) else None
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                request_id = f"gen-{next(self._ids)}"
                self.engine.add_request(request_id, ids, p)
                order[request_id] = i
                texts.append(text)
            results: list[RequestOutput | None] = [None] * len(prompts)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    i = order[out.request_id]
                    out.prompt = texts[i]
                    results[i] = out
        finally:  # a bad prompt, an interrupt: nothing this call added outlives it
            for request_id in order:
                self.engine.abort(request_id)
        return [r for r in results if r is not None]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

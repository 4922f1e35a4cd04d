"""The router's settings: flags (`pdserve router --max-n 4`) or `PDSERVE_*` env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.common.flags import check, flag


@dataclass(frozen=True)
class RouterConfig:
    model: str = flag(DEFAULT_MODEL, "model directory: its tokenizer and limits")
    served_model_name: str | None = flag(None, "model name clients use (default: the directory's name)")
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(50051, "port to listen on (0: any free port)")
    address_file: str | None = flag(None, "write the bound address to this file when serving")
    block_size: int = flag(16, "KV block size (workers must match): prompt block hashes")
    max_model_len: int | None = flag(None, "longest prompt + output (default: the model's)")
    max_n: int = flag(8, "largest n and beam_width accepted")
    max_logprobs: int = flag(20, "largest logprobs and prompt_logprobs accepted (workers must match)")
    local_prefill_threshold: int = flag(64, "uncached prompts shorter than this prefill on the decode worker")
    prefill_queue_weight: int = flag(256, "prefill choice: one queued request costs this many cached tokens")
    heartbeat_interval: float = flag(1.0, "seconds between worker heartbeats")
    worker_timeout: float = flag(3.0, "drop a worker not heard from for this many seconds")
    stats_interval: float = flag(1.0, "seconds between Stats polls (load, cached block hashes)")
    request_timeout: float = flag(600.0, "deadline of requests whose client set none")
    max_attempts: int = flag(3, "workers tried for a request that has produced no token yet")
    max_concurrent_requests: int = flag(256, "Generate calls in flight; more get RESOURCE_EXHAUSTED")
    log_level: str = flag("INFO", "DEBUG | INFO | WARNING | ERROR")

    def __post_init__(self) -> None:
        check(Path(self.model, "config.json").is_file(), "model", "must be a directory with config.json", self.model)
        check(0 <= self.port < 65536, "port", "must be in [0, 65535]", self.port)
        check(self.max_n >= 1, "max_n", "must be >= 1", self.max_n)
        check(self.max_logprobs >= 0, "max_logprobs", "must be >= 0", self.max_logprobs)
        check(self.local_prefill_threshold >= 0, "local_prefill_threshold", "must be >= 0", self.local_prefill_threshold)
        check(self.max_attempts >= 1, "max_attempts", "must be >= 1", self.max_attempts)
        check(self.max_concurrent_requests >= 1, "max_concurrent_requests", "must be >= 1", self.max_concurrent_requests)
        for name in ("heartbeat_interval", "worker_timeout", "stats_interval", "request_timeout"):
            check(getattr(self, name) > 0, name, "must be > 0", getattr(self, name))
        check(self.worker_timeout > self.heartbeat_interval, "worker_timeout", "must exceed heartbeat_interval",
              self.worker_timeout)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

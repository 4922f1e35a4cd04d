"""The router's settings: flags (`pdserve router --max-n 4`) or `PDSERVE_*` env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N, DEFAULT_MODEL
from pdserve.engine.structured.params import MAX_NESTING, MAX_SPEC_BYTES
from pdserve.services.common.credentials import ClusterCredentials
from pdserve.services.common.flags import check, flag
from pdserve.services.router.http.tools.registry import PARSER_NAMES
from pdserve.services.router.structured import DEFAULT_MAX_BYTES, DEFAULT_MAX_DEPTH
from pdserve.services.router.validate import DEFAULT_MAX_PROMPT_BYTES

PREFILL_POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    model: str = flag(DEFAULT_MODEL, "model directory: its tokenizer and limits")
    served_model_name: str | None = flag(None, "model name clients use (default: the directory's name)")
    host: str = flag("127.0.0.1", "address the public API (Generation) listens on")
    port: int = flag(50051, "port of the public API (0: any free port)")
    internal_host: str | None = flag(None, "address the internal Registry listens on (default: --host)")
    internal_port: int | None = flag(None, "port of the internal Registry, where workers register (default: "
                                           "--port + 1; any free port when --port is 0)")
    address_file: str | None = flag(None, "write the bound addresses to this file when serving (public, then "
                                          "internal, one a line)")
    # the OpenAI-compatible HTTP API (services/router/http/), beside gRPC
    http_port: int | None = flag(None, "port of the OpenAI-compatible HTTP API (0: any free port; default: none)")
    http_host: str | None = flag(None, "address the HTTP API listens on (default: --host)")
    chat_template: str | None = flag(None, "Jinja chat template file for /v1/chat/completions (default: the "
                                           "tokenizer's own)")
    tool_call_parser: str = flag("hermes", "how tool calls are read from the model's text under tool_choice auto "
                                           "(the format its chat template asks for)", choices=PARSER_NAMES)
    http_max_body_bytes: int = flag(8 << 20, "largest HTTP request body, refused (413) before it is parsed")
    # the public surface
    api_keys_file: str | None = flag(None, "file of API keys, one a line (reloaded on SIGHUP): every public call "
                                           "must carry `authorization: Bearer <key>`")
    tls_cert: str | None = flag(None, "certificate (PEM) of the public port: TLS for clients")
    tls_key: str | None = flag(None, "private key (PEM) of --tls-cert")
    salt_cache_by_key: bool = flag(False, "put each API key's id in front of every request's cache_salt: tenants "
                                          "never share prefix-cache blocks")
    credentials: ClusterCredentials = flag(ClusterCredentials(), "the cluster's credentials (internal surface)")
    block_size: int = flag(16, "KV block size (workers must match): prompt block hashes")
    max_model_len: int | None = flag(None, "longest prompt + output (default: the model's)")
    max_n: int = flag(DEFAULT_MAX_N, "largest n and beam_width accepted (and each decode worker's registered "
                                     "max_n, checked when it is chosen)")
    max_logprobs: int = flag(DEFAULT_MAX_LOGPROBS, "largest logprobs and prompt_logprobs accepted (and each decode "
                                                   "worker's registered max_logprobs, checked when it is chosen)")
    max_prompt_bytes: int = flag(DEFAULT_MAX_PROMPT_BYTES, "largest text prompt in bytes (UTF-8), refused before "
                                                           "it is tokenized")
    max_prompt_tokens: int | None = flag(None, "largest prompt in tokens (default: max_model_len - 1)")
    # structured outputs: the workers' limits, checked before dispatch (structured.py)
    structured_outputs_max_bytes: int = flag(DEFAULT_MAX_BYTES, "largest structured-outputs constraint (a JSON "
                                                                "schema, regex, grammar or the choices) in bytes; "
                                                                "the workers' own limit")
    structured_outputs_max_depth: int = flag(DEFAULT_MAX_DEPTH, "deepest nesting of a JSON schema (objects and "
                                                                "arrays); the workers' own limit")
    local_prefill_threshold: int = flag(64, "uncached prompts shorter than this prefill on the decode worker")
    prefill_queue_weight: int = flag(256, "prefill choice: one queued request costs this many cached tokens")
    max_prefill_queue: int = flag(0, "a prefill worker with this many requests queued or in flight from this router "
                                     "takes no more; with every one that full, prefill on the decode worker (0: no "
                                     "limit)")
    prefill_policy: str = flag("prefix", "prefill worker choice: prefix (longest cached prefix, balanced by "
                                         "queue) | round_robin (in turn, ignoring caches: a baseline)")
    heartbeat_interval: float = flag(1.0, "seconds between worker heartbeats")
    worker_timeout: float = flag(3.0, "drop a worker not heard from for this many seconds")
    stats_interval: float = flag(1.0, "seconds between Stats polls of worker load (what workers cache "
                                               "comes as KV events)")
    request_timeout: float = flag(600.0, "deadline of requests whose client set none")
    max_attempts: int = flag(3, "workers tried for a request that has produced no token yet")
    max_migrations: int = flag(3, "times a request whose decode worker failed after tokens were sent continues on "
                                  "another worker (from the prompt plus the tokens sent; 0: it fails UNAVAILABLE)")
    max_concurrent_requests: int = flag(256, "Generate calls in flight; more wait in the admission queue")
    max_queued_requests: int = flag(64, "Generate calls waiting for a slot; more get RESOURCE_EXHAUSTED with a "
                                        "retry hint (0: no queue)")
    max_queue_wait: float = flag(1.0, "longest a call waits in the admission queue before RESOURCE_EXHAUSTED")
    stream_write_timeout: float = flag(10.0, "cut off a client that takes longer than this to accept one message "
                                             "(it stopped reading); its request is aborted on every worker")
    admission_timeout: float = flag(5.0, "a request that finds no decode worker registered waits this long (within "
                                         "its deadline) for one to join before UNAVAILABLE (0: fail at once)")
    drain_timeout: float = flag(30.0, "on SIGTERM: stop admitting, finish requests in flight for up to this many "
                                      "seconds, then fail the rest with UNAVAILABLE and exit")
    log_level: str = flag("INFO", "DEBUG | INFO | WARNING | ERROR")
    # Prometheus (services/common/metrics.py)
    metrics: bool = flag(True, "record Prometheus metrics and serve them at /metrics")
    metrics_host: str | None = flag(None, "address /metrics listens on (default: --host)")
    metrics_port: int = flag(0, "HTTP port of /metrics (0: any free port); never the gRPC port")

    def __post_init__(self) -> None:
        check(Path(self.model, "config.json").is_file(), "model", "must be a directory with config.json", self.model)
        check(0 <= self.port < 65536, "port", "must be in [0, 65535]", self.port)
        check(self.internal_port is None or 0 <= self.internal_port < 65536, "internal_port", "must be in [0, 65535]",
              self.internal_port)
        check(self.internal_port is not None or self.port < 65535, "internal_port", "needed when --port is 65535",
              self.internal_port)
        check((self.tls_cert is None) == (self.tls_key is None), "tls_cert", "--tls-cert and --tls-key go together",
              self.tls_cert)
        for name in ("api_keys_file", "tls_cert", "tls_key"):
            path = getattr(self, name)
            check(path is None or Path(path).is_file(), name, "must be a readable file", path)
        check(not self.salt_cache_by_key or self.api_keys_file is not None, "salt_cache_by_key",
              "needs --api-keys-file", self.salt_cache_by_key)
        check(self.http_port is None or 0 <= self.http_port < 65536, "http_port", "must be in [0, 65535]",
              self.http_port)
        check(self.http_port is None or self.http_port == 0 or self.http_port != self.port, "http_port",
              "must differ from port", self.http_port)
        check(self.chat_template is None or Path(self.chat_template).is_file(), "chat_template",
              "must be a readable file", self.chat_template)
        check(self.http_max_body_bytes >= 1024, "http_max_body_bytes", "must be >= 1024", self.http_max_body_bytes)
        check(0 <= self.metrics_port < 65536, "metrics_port", "must be in [0, 65535]", self.metrics_port)
        check(self.metrics_port == 0 or self.metrics_port != self.port, "metrics_port", "must differ from port",
              self.metrics_port)
        check(self.max_n >= 1, "max_n", "must be >= 1", self.max_n)
        check(self.max_logprobs >= 0, "max_logprobs", "must be >= 0", self.max_logprobs)
        check(self.local_prefill_threshold >= 0, "local_prefill_threshold", "must be >= 0", self.local_prefill_threshold)
        check(self.max_prefill_queue >= 0, "max_prefill_queue", "must be >= 0", self.max_prefill_queue)
        check(self.prefill_policy in PREFILL_POLICIES, "prefill_policy", f"must be one of {PREFILL_POLICIES}",
              self.prefill_policy)
        check(self.max_attempts >= 1, "max_attempts", "must be >= 1", self.max_attempts)
        check(self.max_migrations >= 0, "max_migrations", "must be >= 0", self.max_migrations)
        check(self.max_concurrent_requests >= 1, "max_concurrent_requests", "must be >= 1", self.max_concurrent_requests)
        check(self.max_queued_requests >= 0, "max_queued_requests", "must be >= 0", self.max_queued_requests)
        check(self.max_queue_wait >= 0, "max_queue_wait", "must be >= 0", self.max_queue_wait)
        check(1 <= self.structured_outputs_max_bytes <= MAX_SPEC_BYTES, "structured_outputs_max_bytes",
              f"must be in [1, {MAX_SPEC_BYTES}]", self.structured_outputs_max_bytes)
        check(1 <= self.structured_outputs_max_depth <= MAX_NESTING, "structured_outputs_max_depth",
              f"must be in [1, {MAX_NESTING}]", self.structured_outputs_max_depth)
        check(self.max_prompt_bytes >= 1, "max_prompt_bytes", "must be >= 1", self.max_prompt_bytes)
        check(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1, "max_prompt_tokens", "must be >= 1",
              self.max_prompt_tokens)
        for name in ("admission_timeout", "drain_timeout"):
            check(getattr(self, name) >= 0, name, "must be >= 0", getattr(self, name))
        for name in ("heartbeat_interval", "worker_timeout", "stats_interval", "request_timeout", "stream_write_timeout"):
            check(getattr(self, name) > 0, name, "must be > 0", getattr(self, name))
        check(self.worker_timeout > self.heartbeat_interval, "worker_timeout", "must exceed heartbeat_interval",
              self.worker_timeout)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def public_http_host(self) -> str:
        return self.http_host or self.host

    @property
    def registry_host(self) -> str:
        return self.internal_host or self.host

    @property
    def registry_port(self) -> int:
        if self.internal_port is not None:
            return self.internal_port
        return self.port + 1 if self.port else 0

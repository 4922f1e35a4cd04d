"""A worker's settings: from flags (`pdserve decode --num-blocks 512`) or the
environment (`PDSERVE_NUM_BLOCKS=512`); see services/common/flags.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import (
    AUTO_DTYPE, DTYPES, DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N, DEFAULT_MODEL, STRUCTURED_FIELDS, STRUCTURED_OUTPUTS_BACKENDS, CacheConfig,
    EngineConfig, SchedulerConfig, check_structured_fields,
)
from pdserve.engine.offload.config import check_offload_fields
from pdserve.engine.quant.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, parse_kv_cache_dtype
from pdserve.engine.spec.config import EAGLE_METHODS, SpeculativeConfig
from pdserve.services.common.credentials import ClusterCredentials
from pdserve.services.common.flags import check, flag
from pdserve.services.worker.registration import parse_routers

ROLES = ("prefill", "decode", "mixed")
# KV pages over ZeroMQ tcp (kvtransfer/registry.py): what `pdserve up` gives prefill
# and decode workers unless --kv-connector says otherwise.
DEFAULT_KV_CONNECTOR = "zmq"
# The engine's KV tier settings, flags of the same names (engine/offload/config.py).
OFFLOAD_FIELDS = ("kv_offload_host_bytes", "kv_offload_dir", "kv_offload_disk_bytes", "kv_offload_persist",
                  "kv_offload_policy", "kv_offload_disk_policy", "kv_offload_queue_depth", "kv_offload_deadline",
                  "kv_offload_onload_timeout", "kv_offload_fsync")


def parse_cpus(text: str) -> set[int]:
    """'0', '0,2' or '0-3,6' -> CPU ids. Raises ValueError naming cpu_affinity."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"cpu_affinity: expected CPU ids like '0,2-3', got {text!r}") from None
        check(0 <= first <= last, "cpu_affinity", "needs ranges LOW-HIGH of CPU ids >= 0", text)
        cpus.update(range(first, last + 1))
    return cpus


@dataclass(frozen=True)
class WorkerConfig:
    role: str = flag("mixed", "prefill | decode | mixed", cli=False)
    model: str = flag(DEFAULT_MODEL, "model directory (Hugging Face format)")
    served_model_name: str | None = flag(None, "model name clients use (default: the directory's name)")
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(0, "port to listen on (0: any free port)")
    router: str | None = flag(None, "the routers' internal (Registry) addresses to register with, comma-separated; "
                                    "a DNS name stands for every address it resolves to (a headless Service), "
                                    "looked up every --router-resolve-interval (none: standalone)")
    router_resolve_interval: float = flag(2.0, "seconds between lookups of --router's DNS names (routers added "
                                               "are joined, routers gone are let be)")
    worker_id: str | None = flag(None, "unique worker id (default: role-pid)")
    advertise_host: str | None = flag(None, "host the router should dial (default: --host)")
    address_file: str | None = flag(None, "write the bound address to this file when serving")
    # engine
    block_size: int = flag(16, "KV cache block size in tokens")
    num_blocks: int | None = flag(None, "KV cache blocks (default: sized from --kv-cache-memory)")
    kv_cache_memory: int | None = flag(None, "KV cache bytes (default: 1 GiB on a CPU; on a GPU what "
                                             "--gpu-memory-utilization leaves)")
    gpu_memory_utilization: float = flag(0.9, "share of the GPU's memory this worker may use (weights, activation "
                                              "peak, KV cache: the KV cache gets what is left; vLLM's flag)")
    enable_prefix_caching: bool = flag(True, "reuse the KV of cached prompt prefixes")
    max_num_seqs: int = flag(256, "most sequences in a batch")
    max_num_batched_tokens: int = flag(2048, "token budget of one engine step")
    max_model_len: int | None = flag(None, "longest prompt + output (default: the model's)")
    max_n: int = flag(DEFAULT_MAX_N, "largest n and beam_width accepted (registered: the router checks it)")
    max_logprobs: int = flag(DEFAULT_MAX_LOGPROBS, "largest logprobs and prompt_logprobs accepted (registered)")
    dtype: str = flag("auto", "auto | float32 | float16 | bfloat16 (auto: on a CPU bfloat16 where it has AMX or "
                              "AVX512-BF16, else float32; on a GPU bfloat16, else float16); every role alike")
    quantization: str | None = flag(None, f"quantize the full-precision checkpoint while loading it: "
                                          f"{' | '.join(QUANTIZATION_METHODS)} (unset: the checkpoint's own format); "
                                          "every role alike: a prefill and a decode worker must share it")
    kv_cache_dtype: str = flag("auto", f"KV cache pages' dtype: {' | '.join(KV_CACHE_DTYPES)} (auto: the model's; "
                                       "fp8 = fp8_e4m3); every role alike: KV moves between workers as stored")
    device: str = flag("cpu", "torch device")
    attention_backend: str = flag("auto", "auto | torch | triton")
    seed: int = flag(0, "seed of the sampler's shared generator")
    torch_threads: int | None = flag(None, "torch intra-op threads (unset: one per CPU this worker may use: its "
                                           "affinity, capped by its cgroup's CPU limit; `pdserve up` gives each "
                                           "local worker its own share of the cores; 0: torch's own default)")
    enforce_eager: bool = flag(False, "run every step on the eager path (vLLM's flag): full-precision linear "
                                      "layers stay plain instead of oneDNN-prepacked on a CPU")
    decode_capture_sizes: str | None = flag(None, "compile the pure decode step at start-up for these batch sizes, "
                                                  "e.g. '1,4,16' (vLLM's cudagraph_capture_sizes; a CPU, full-"
                                                  "precision weights; seconds of start-up a size; unset: none, "
                                                  "every step eager)")
    cpu_affinity: str | None = flag(None, "pin every thread of this process to these CPUs, e.g. '0' or '0,2-3' "
                                          "(os.sched_setaffinity; unset: not pinned)")
    speculative_config: str | None = flag(None, "speculative decoding, vLLM's speculative_config as a JSON object, "
                                                "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' "
                                                "(decode and mixed workers; a prefill worker never decodes and "
                                                "ignores it; unset: off)")
    # the KV tiers below the device pool (engine/offload/)
    kv_offload_host_bytes: int = flag(0, "host-memory KV tier's bytes (pinned on a GPU host): blocks evicted from "
                                         "the device pool are copied here and copied back on a prefix hit (0: off)")
    kv_offload_dir: str | None = flag(None, "directory of the disk KV tier, one checked file per block (unset: off)")
    kv_offload_disk_bytes: int = flag(0, "disk KV tier's bytes (needed with --kv-offload-dir)")
    kv_offload_persist: bool = flag(False, "keep the disk tier's blocks across restarts (found again at start); "
                                           "off: this model's files there are deleted at start")
    kv_offload_policy: str = flag("lru", "eviction policy of the KV tiers: lru | arc", choices=("lru", "arc"))
    kv_offload_disk_policy: str | None = flag(None, "the disk tier's own policy: lru | arc (unset: "
                                                    "--kv-offload-policy)", choices=("lru", "arc"))
    kv_offload_queue_depth: int = flag(256, "blocks waiting to be copied down at most (more are dropped, never "
                                            "waited for)")
    kv_offload_deadline: float = flag(5.0, "seconds a block may wait to be copied down")
    kv_offload_onload_timeout: float = flag(2.0, "seconds one admission may spend copying blocks up (then the "
                                                 "rest is recomputed)")
    kv_offload_fsync: bool = flag(False, "fsync each disk tier file before it counts")
    # structured outputs (engine/structured/): every role alike (a prefill worker samples
    # the first token under the same constraint)
    structured_outputs_backend: str = flag("xgrammar", "grammar engine of constrained decoding: xgrammar | "
                                                       "llguidance (grammar kind: GBNF/EBNF | Lark)",
                                           choices=STRUCTURED_OUTPUTS_BACKENDS)
    structured_outputs_compile_timeout: float = flag(10.0, "seconds a request's grammar may take to compile (then "
                                                           "the request fails: DEADLINE_EXCEEDED)")
    structured_outputs_max_bytes: int = flag(64 * 1024, "largest constraint admitted (schema, regex, grammar or "
                                                        "choices, bytes)")
    structured_outputs_max_depth: int = flag(32, "deepest JSON schema nesting admitted")
    # serving
    kv_connector: str | None = flag(None, "KV transport: zmq | zmq_ipc | gloo | nccl | none ('' too) | a plug-in's "
                                          "'module:factory' (unset: `pdserve up` gives prefill and decode workers "
                                          f"{DEFAULT_KV_CONNECTOR}, others none)")
    reservation_timeout: float = flag(30.0, "decode: longest wait for a reservation's KV")
    held_lease: float = flag(30.0, "prefill: longest time exported blocks wait to be shipped")
    request_timeout: float = flag(600.0, "longest a request may run when its caller set no deadline")
    register_timeout: float = flag(60.0, "how long to keep trying to register with a router: the worker exits if "
                                         "none accepted it by then (the others are retried while it serves)")
    stream_write_timeout: float = flag(10.0, "decode: cut off a token stream whose reader takes longer than this "
                                             "to accept one message (it stopped reading); its blocks are freed")
    drain_timeout: float = flag(30.0, "on SIGTERM: leave the router's pools, finish requests in flight for up to "
                                      "this many seconds, then fail the rest with UNAVAILABLE and exit")
    grpc_threads: int | None = flag(None, "Reserve, Prefill and Decode calls served at once, each holding a thread "
                                             "(more get RESOURCE_EXHAUSTED; default: 2 * max_num_seqs + 16); "
                                             "Abort, Stats, Drain and KvEvents have threads of their own")
    log_level: str = flag("INFO", "DEBUG | INFO | WARNING | ERROR")
    credentials: ClusterCredentials = flag(ClusterCredentials(), "the cluster's credentials (internal surface)")
    # Prometheus (services/common/metrics.py)
    metrics: bool = flag(True, "record Prometheus metrics and serve them at /metrics")
    metrics_host: str | None = flag(None, "address /metrics listens on (default: --host)")
    metrics_port: int = flag(0, "HTTP port of /metrics (0: any free port); never the gRPC port")

    def __post_init__(self) -> None:
        check(self.role in ROLES, "role", f"must be one of {ROLES}", self.role)
        check(Path(self.model, "config.json").is_file(), "model", "must be a directory with config.json", self.model)
        check(0 <= self.port < 65536, "port", "must be in [0, 65535]", self.port)
        check(0 <= self.metrics_port < 65536, "metrics_port", "must be in [0, 65535]", self.metrics_port)
        check(self.metrics_port == 0 or self.metrics_port != self.port, "metrics_port", "must differ from port",
              self.metrics_port)
        check(self.max_n >= 1, "max_n", "must be >= 1", self.max_n)
        check(self.max_logprobs >= 0, "max_logprobs", "must be >= 0", self.max_logprobs)
        check(self.quantization is None or self.quantization in QUANTIZATION_METHODS, "quantization",
              f"must be one of {QUANTIZATION_METHODS}", self.quantization)
        check(self.dtype in (AUTO_DTYPE, *DTYPES), "dtype", f"must be one of {(AUTO_DTYPE, *DTYPES)}", self.dtype)
        parse_kv_cache_dtype(self.kv_cache_dtype)  # raises ValueError naming kv_cache_dtype
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]",
              self.gpu_memory_utilization)
        check(self.torch_threads is None or self.torch_threads >= 0, "torch_threads", "must be >= 0", self.torch_threads)
        if self.cpu_affinity is not None:
            parse_cpus(self.cpu_affinity)  # raises ValueError naming the field
        check(self.grpc_threads is None or self.grpc_threads >= 4, "grpc_threads", "must be >= 4", self.grpc_threads)
        if self.router is not None:
            parse_routers(self.router)  # raises ValueError naming router
        for name in ("reservation_timeout", "held_lease", "request_timeout", "register_timeout", "stream_write_timeout",
                     "router_resolve_interval"):
            check(getattr(self, name) > 0, name, "must be > 0", getattr(self, name))
        check(self.drain_timeout >= 0, "drain_timeout", "must be >= 0", self.drain_timeout)
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # raises ValueError naming speculative_config.<key>
        check_offload_fields(self)  # raises ValueError naming the flag
        check_structured_fields(self)  # so does this

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config, parsed and checked (None: off)."""
        return SpeculativeConfig.parse(self.speculative_config) if self.speculative_config is not None else None

    @property
    def cpus(self) -> set[int] | None:
        return parse_cpus(self.cpu_affinity) if self.cpu_affinity is not None else None

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def id(self) -> str:
        return self.worker_id or f"{self.role}-{os.getpid()}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device,
            cache=CacheConfig(self.block_size, self.num_blocks, self.kv_cache_memory, self.enable_prefix_caching),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len),
            attention_backend=self.attention_backend, seed=self.seed, max_n=self.max_n,
            max_logprobs=self.max_logprobs, gpu_memory_utilization=self.gpu_memory_utilization,
            # Every role alike: the KV a prefill worker ships is read as stored by its decode worker.
            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
            enforce_eager=self.enforce_eager,
            **{name: getattr(self, name) for name in (*OFFLOAD_FIELDS, *STRUCTURED_FIELDS)},
            decode_capture_sizes=self.decode_capture_sizes or (),  # type: ignore[arg-type]  # parsed there
            # Only decoding speculates: a prefill worker would load a draft model for nothing.
            # An EAGLE head runs on both: the prefill worker hands its state for the prompt over.
            speculative=self.speculative if self.role != "prefill" or _eagle(self.speculative) else None,
        )


def _eagle(spec: SpeculativeConfig | None) -> bool:
    return spec is not None and spec.method in EAGLE_METHODS

"""`pdserve plan`: what one worker holds, and how many a load needs, for a model's
storage choices side by side, without reading a weight.

    pdserve plan --model DIR --gpu-memory 80 --max-model-len 8192 --concurrency 256 \\
        [--quantization int8] [--kv-cache-dtype fp8] [--prompt-len 2048 --output-len 512] \\
        [--kv-offload-host-bytes B] [--kv-offload-disk-bytes B]

    choices      weights: as given, and unquantized (when --quantization is given)
                 KV: as given, auto, fp8_e4m3, fp8_e5m2
        |
        v  engine.memory.plan_memory (the model built on torch's meta device)
    one row each: weight bytes, KV bytes per token, blocks, sequences one worker holds,
                  workers for --concurrency sequences, KV bytes a request ships P -> D

The KV budget is the worker's: --kv-cache-memory bytes when given (as on a worker, it
wins), else --gpu-memory GiB x --gpu-memory-utilization - weights - activation peak,
else a CPU worker's default (1 GiB). A worker started with a row's flags logs the same
weight bytes, KV bytes per token, blocks and max concurrency at start (`memory: ...`).
Sequences are `--prompt-len + --output-len` tokens long when given, else
--max-model-len; a worker holds as many as its blocks fit, at most --max-num-seqs. What a
request ships is whole KV pages of its prompt, none cached on the decode worker (what
`pdserve:kv_transfer_bytes` counts). The KV tiers below the device pool (as the
workers' --kv-offload-host-bytes, --kv-offload-disk-bytes) are each worker's bytes
beside its device memory: the host tier whole blocks of a row's size (as a worker
allocates it), shown per row, and in the worker's memory line alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.memory import GIB, MemoryPlan, plan_memory
from pdserve.engine.quant.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, parse_kv_cache_dtype
from pdserve.services.common.flags import check, flag

KV_ALTERNATIVES = ("auto", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class PlanConfig:
    model: str = flag(DEFAULT_MODEL, "model directory (Hugging Face format): only config.json is read")
    dtype: str = flag("float32", "float32 | float16 | bfloat16 (the workers' --dtype)")
    quantization: str | None = flag(None, f"weights quantized while loading: {' | '.join(QUANTIZATION_METHODS)} "
                                          "(unset: the checkpoint's own format)")
    kv_cache_dtype: str = flag("auto", f"KV cache pages' dtype: {' | '.join(KV_CACHE_DTYPES)}")
    gpu_memory: float | None = flag(None, "GiB of memory on one worker's device")
    gpu_memory_utilization: float = flag(0.9, "share of --gpu-memory a worker may use")
    kv_cache_memory: int | None = flag(None, "KV cache bytes of one worker (as the worker's flag: wins over "
                                             "--gpu-memory; the way to plan CPU workers)")
    max_model_len: int | None = flag(None, "longest prompt + output (default: the model's)")
    concurrency: int | None = flag(None, "sequences to serve at once (required)")
    prompt_len: int | None = flag(None, "prompt tokens of a typical request (with --output-len)")
    output_len: int | None = flag(None, "output tokens of a typical request (with --prompt-len)")
    block_size: int = flag(16, "KV cache block size in tokens")
    max_num_batched_tokens: int = flag(2048, "token budget of one engine step (sets the activation peak)")
    max_num_seqs: int = flag(256, "most sequences in a worker's batch")
    kv_offload_host_bytes: int = flag(0, "host-memory KV tier of one worker (the workers' flag; 0: none)")
    kv_offload_disk_bytes: int = flag(0, "disk KV tier of one worker (the workers' flag; 0: none)")
    json: bool = flag(False, "print the rows as one JSON list instead of a table")

    def __post_init__(self) -> None:
        check(Path(self.model, "config.json").is_file(), "model", "must be a directory with config.json", self.model)
        check(self.quantization is None or self.quantization in QUANTIZATION_METHODS, "quantization",
              f"must be one of {QUANTIZATION_METHODS}", self.quantization)
        parse_kv_cache_dtype(self.kv_cache_dtype)  # raises ValueError naming kv_cache_dtype
        check(self.gpu_memory is None or self.gpu_memory > 0, "gpu_memory", "must be > 0 GiB", self.gpu_memory)
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]",
              self.gpu_memory_utilization)
        check(self.kv_cache_memory is None or self.kv_cache_memory >= 1, "kv_cache_memory", "must be >= 1 byte",
              self.kv_cache_memory)
        check(self.concurrency is not None and self.concurrency >= 1, "concurrency", "must be given, >= 1",
              self.concurrency)
        check((self.prompt_len is None) == (self.output_len is None), "prompt_len",
              "--prompt-len and --output-len go together", self.prompt_len)
        check(self.prompt_len is None or self.prompt_len >= 1, "prompt_len", "must be >= 1", self.prompt_len)
        check(self.output_len is None or self.output_len >= 0, "output_len", "must be >= 0", self.output_len)
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes"):
            check(getattr(self, name) >= 0, name, "must be >= 0 bytes", getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, "must be >= 1", value)

    @property
    def device_memory(self) -> int | None:
        return int(self.gpu_memory * GIB) if self.gpu_memory is not None else None

    def choices(self) -> list[tuple[str | None, str]]:
        """(quantization, kv_cache_dtype) of each row, the given pair first."""
        weights = [self.quantization] + ([None] if self.quantization is not None else [])
        given = parse_kv_cache_dtype(self.kv_cache_dtype)
        kv = [self.kv_cache_dtype] + [d for d in KV_ALTERNATIVES if parse_kv_cache_dtype(d) != given]
        return [(w, k) for w in weights for k in kv]


@dataclass(frozen=True)
class Row:
    """One choice's plan and what it means for the load (plan None: it does not fit;
    `error` says why)."""

    quantization: str | None
    kv_cache_dtype: str
    given: bool
    plan: MemoryPlan | None
    sequence_tokens: int
    sequences_per_worker: int
    workers: int | None  # workers for --concurrency sequences (None: a sequence does not fit one)
    kv_bytes_shipped: int | None  # per request, prefill -> decode (None without --prompt-len)
    error: str | None = None

    def record(self) -> dict:
        """For --json: the row's flags, the plan's fields (the torch dtype of the pages as
        `kv_cache_dtype`, as the worker logs it) and what they mean for the load."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("plan", "quantization", "kv_cache_dtype")}
        fields["flags"] = {"quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype}
        if self.plan is not None:
            fields.update(asdict(self.plan), max_concurrency=self.plan.max_concurrency)
        return fields


def plan_row(config: PlanConfig, quantization: str | None, kv_cache_dtype: str, given: bool) -> Row:
    try:
        plan = plan_memory(
            config.model, dtype=config.dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            block_size=config.block_size, max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            kv_cache_memory=config.kv_cache_memory, device_memory=config.device_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            device="cpu" if config.device_memory is None else "cuda",
            kv_offload_host_bytes=config.kv_offload_host_bytes, kv_offload_disk_bytes=config.kv_offload_disk_bytes,
        )
    except ValueError as e:  # no room for one block, a scheme the checkpoint refuses, ...
        return Row(quantization, kv_cache_dtype, given, None, 0, 0, None, None, str(e))
    tokens = plan.max_model_len if config.prompt_len is None else config.prompt_len + (config.output_len or 0)
    check(tokens <= plan.max_model_len, "prompt_len", f"+ --output-len exceeds max_model_len {plan.max_model_len}",
          config.prompt_len)
    fit = plan.max_concurrency if config.prompt_len is None else min(plan.sequences_of(tokens), config.max_num_seqs)
    assert config.concurrency is not None
    workers = -(-config.concurrency // fit) if fit else None
    shipped = None if config.prompt_len is None else -(-config.prompt_len // plan.block_size) * plan.kv_bytes_per_block
    return Row(quantization, kv_cache_dtype, given, plan, tokens, fit, workers, shipped)


def plan(config: PlanConfig) -> list[Row]:
    """Every choice's row, the given one first. Raises ValueError when none fits (the
    given choice's reason)."""
    rows = [plan_row(config, q, kv, i == 0) for i, (q, kv) in enumerate(config.choices())]
    if all(r.plan is None for r in rows):
        raise ValueError(rows[0].error)
    return rows


def human(n: int | None) -> str:
    """Bytes as people read them: 512 B, 3.5 KiB, 1.25 GiB."""
    if n is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def budget_text(config: PlanConfig) -> str:
    if config.kv_cache_memory is not None:
        return f"--kv-cache-memory {human(config.kv_cache_memory)}"
    if config.gpu_memory is not None:
        return (f"{config.gpu_memory:g} GiB x {config.gpu_memory_utilization:g} - weights - activation peak "
                "(--gpu-memory)")
    return "a CPU worker's default (1 GiB; give --gpu-memory or --kv-cache-memory)"


def tiers_text(config: PlanConfig) -> list[str]:
    """The KV tiers' line (none without them)."""
    if not (config.kv_offload_host_bytes or config.kv_offload_disk_bytes):
        return []
    return [f"KV tiers per worker, beside the device's: host memory {human(config.kv_offload_host_bytes)} "
            f"(--kv-offload-host-bytes), disk {human(config.kv_offload_disk_bytes)} (--kv-offload-disk-bytes)"]


def header(config: PlanConfig) -> tuple[str, ...]:
    return HEADER + (("host tier",) if config.kv_offload_host_bytes else ())


HEADER = ("", "weights", "KV cache", "weight bytes", "KV/token", "blocks", "seqs/worker", "workers", "ships/request")


def table(config: PlanConfig, rows: list[Row]) -> str:
    first = next(r.plan for r in rows if r.plan is not None)
    length = (f"{config.prompt_len + (config.output_len or 0)} tokens (prompt {config.prompt_len} + output "
              f"{config.output_len})" if config.prompt_len is not None else f"max-model-len {first.max_model_len}")
    lines = [f"model {Path(config.model).resolve().name}, dtype {config.dtype}, block size {config.block_size}, "
             f"max-model-len {first.max_model_len}, activation peak {human(first.activation_peak_bytes)} "
             "(an estimate: a GPU worker measures its own)",
             f"KV budget per worker: {budget_text(config)}",
             *tiers_text(config),
             f"load: {config.concurrency} concurrent sequences of {length}", ""]
    head = header(config)
    cells = [head]
    for r in rows:
        mark = "*" if r.given else ""
        kv = r.kv_cache_dtype if r.plan is None else f"{r.kv_cache_dtype} ({r.plan.kv_cache_dtype})"
        if r.plan is None:
            cells.append((mark, r.quantization or config.dtype, kv, "does not fit", *[""] * (len(head) - 4)))
            continue
        host = (f"{r.plan.host_tier_bytes // r.plan.kv_bytes_per_block} blocks",) if len(head) > len(HEADER) else ()
        cells.append((mark, r.plan.weight_scheme, kv, human(r.plan.weight_bytes), human(r.plan.kv_bytes_per_token),
                      str(r.plan.num_blocks), str(r.sequences_per_worker),
                      str(r.workers) if r.workers is not None else "none fits", human(r.kv_bytes_shipped), *host))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cell, widths))).rstrip()
              for cell in cells]
    lines += ["", "* the flags given",
              "seqs/worker: sequences one worker's KV blocks hold (at most --max-num-seqs)",
              "workers: decode (or mixed) workers the load needs",
              "ships/request: the KV pages of one prompt, prefill -> decode (with --prompt-len)"]
    if len(head) > len(HEADER):
        lines.append("host tier: blocks of this row's size the host-memory tier keeps below the device pool")
    lines += [f"{r.quantization or config.dtype} + {r.kv_cache_dtype}: {r.error}" for r in rows if r.error]
    return "\n".join(lines)


def run(config: PlanConfig) -> int:
    rows = plan(config)
    print(json.dumps([r.record() for r in rows], indent=1) if config.json else table(config, rows))
    return 0

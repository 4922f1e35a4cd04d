"""Frozen configuration for one engine: the model, the KV cache and the scheduler.

`ModelConfig.from_hf_config` reads a Hugging Face `config.json` dict. It accepts both
the transformers 4 spelling (`rope_theta` + `rope_scaling`) and the transformers 5
spelling (`rope_parameters`, nested per layer type for Gemma 3), and refuses features
the forward pass does not implement instead of silently computing something else.
Which architectures exist, and how each one's config reads, is the model registry's
(engine/model/registry.py); derived RoPE values (yarn's and longrope's attention
factor, a missing factor) are resolved here as transformers resolves them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.offload.config import check_offload_fields
from pdserve.engine.model.registry import SUPPORTED_ARCHITECTURES, Family, family, resolve_architecture  # noqa: F401
from pdserve.engine.quant.config import QUANTIZATION_METHODS, parse_kv_cache_dtype
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.structured.params import MAX_NESTING, MAX_SPEC_BYTES

if TYPE_CHECKING:
    import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MAX_LOGPROBS = 20  # as vLLM's max_logprobs
# Largest n and beam_width: the one default of the engine, the workers' and the router's --max-n
# (a decode worker registers its own, and the router checks a request against it).
DEFAULT_MAX_N = 8
# The embedded default model (models/ at the repository root).
DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "pdserve-tiny-code")
# Its draft model for speculative decoding: same tokenizer, trained on the same text.
DEFAULT_DRAFT_MODEL = DEFAULT_MODEL + "-draft"
# Its EAGLE-3 head (scripts/train_eagle_head.py), for speculative_config method eagle3.
DEFAULT_EAGLE3_HEAD = DEFAULT_MODEL + "-eagle3"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch  # here, not at the top: the router reads this module's configs without torch

    if isinstance(name, torch.dtype):
        if name not in {getattr(torch, n) for n in DTYPES}:
            raise ValueError(f"dtype: unsupported {name}; choose one of {sorted(DTYPES)}")
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype: unsupported {name!r}; choose one of {sorted(DTYPES)}")
    return getattr(torch, name)


AUTO_DTYPE = "auto"


def cpu_bf16_native() -> str | None:
    """What makes this CPU compute in bfloat16 natively ("AMX", "AVX512-BF16"), or None:
    elsewhere bfloat16 arithmetic is emulated, slower than float32."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return None


def resolve_dtype(name: str | torch.dtype, device: str | torch.device,
                  checkpoint: str | None = None) -> tuple[torch.dtype, str]:
    """The weights' and activations' dtype for `name` on `device`, and why. "auto" keeps
    a float32 checkpoint in float32 (its own precision: fewer bits would change its
    tokens) and runs a half-precision one (`checkpoint`, or none named) in bfloat16 where
    the hardware computes in it natively (a CPU with AMX or AVX512-BF16, a GPU that has
    it; else a GPU's float16), on a CPU without those in float32: emulated bfloat16 is
    slower than float32."""
    import torch

    if name != AUTO_DTYPE:
        return parse_dtype(name), "as asked (--dtype)"
    if checkpoint == "float32":
        return torch.float32, "auto: the checkpoint is float32"
    device = torch.device(device)
    saved = f"the checkpoint is {checkpoint}" if checkpoint else "the checkpoint names no dtype"
    if device.type == "cpu":
        native = cpu_bf16_native()
        if native is not None:
            return torch.bfloat16, f"auto: {saved}, this CPU has {native}"
        return torch.float32, (f"auto: {saved}, this CPU ({torch.backends.cpu.get_cpu_capability()}) has neither "
                               "AMX nor AVX512-BF16")
    if device.type == "cuda":
        if checkpoint == "float16":
            return torch.float16, f"auto: {saved}"
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"auto: {saved}, this GPU computes in bfloat16"
        return torch.float16, f"auto: {saved}, this GPU has no bfloat16"
    return torch.float32, f"auto: {saved}, {device.type} device"


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE's parameters, as transformers' rope_parameters holds them, with the
    derived ones resolved: `factor` (yarn / longrope without one: max / original
    positions) and `attention_factor` (the scale of cos and sin: yarn's mscale,
    longrope's sqrt(1 + ln(factor) / ln(original)), 1.0 for the other types)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 2048  # dynamic's reference length
    attention_factor: float = 1.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # One entry per layer: None for full attention, else the window length.
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma); None: head_dim
    attn_logit_softcapping: float | None = None  # tanh(s / cap) * cap on attention scores (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the LM head's logits (Gemma)
    # Sliding-window layers' own RoPE (Gemma 3's local base); None: `rope` everywhere.
    rope_local: RopeConfig | None = None
    # The dtype the checkpoint was saved in (config.json "dtype", formerly "torch_dtype"),
    # one of DTYPES; None when it says none or another (--dtype auto then takes float32).
    checkpoint_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no config.json in {model_dir}")
        cfg = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf_config(cfg, gen)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        arch = resolve_architecture(list(cfg.get("architectures") or []))
        fam = family(arch)
        cfg = {**fam.defaults, **cfg}
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_kv = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            raise ValueError(f"num_key_value_heads: {num_kv} does not divide num_attention_heads {num_heads}")
        num_layers = int(cfg["num_hidden_layers"])
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = _eos_ids(cfg, generation or {})
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: only causal attention is supported")
        rope, rope_local = _ropes(cfg, fam)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=fam.qkv_bias or attention_bias,
            o_bias=attention_bias and not fam.qkv_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(cfg, fam, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            hidden_act=_activation(cfg),
            qk_norm=fam.qk_norm,
            query_pre_attn_scalar=_optional_float(cfg, "query_pre_attn_scalar"),
            attn_logit_softcapping=_optional_float(cfg, "attn_logit_softcapping") if fam.attn_softcap else None,
            final_logit_softcapping=_optional_float(cfg, "final_logit_softcapping"),
            rope_local=rope_local,
            checkpoint_dtype=_checkpoint_dtype(cfg),
        )


def _checkpoint_dtype(cfg: dict[str, Any]) -> str | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    name = {"float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}.get(name, name)
    return name if name in DTYPES else None


def _eos_ids(cfg: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _optional_float(cfg: dict[str, Any], name: str) -> float | None:
    value = cfg.get(name)
    if value is None:
        return None
    if not float(value) > 0:
        raise ValueError(f"{name}: must be a positive number or null, got {value!r}")
    return float(value)


def _activation(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act: {act!r} not supported ({', '.join(SUPPORTED_ACTIVATIONS)})")
    return act


def _ropes(cfg: dict[str, Any], fam: Family) -> tuple[RopeConfig, RopeConfig | None]:
    """The global RoPE and, for a family with local RoPE (Gemma 3), the sliding layers'
    one: transformers 5 nests rope_parameters by layer type; transformers 4 spelled the
    local base `rope_local_base_freq` beside `rope_theta` + `rope_scaling` (global)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if not fam.local_rope:
        return _rope_config(params, cfg, "rope_parameters"), None
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = params, {}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1000000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return (_rope_config(full, cfg, "rope_parameters.full_attention"),
            _rope_config(local, cfg, "rope_parameters.sliding_attention"))


def _rope_config(params: dict[str, Any], cfg: dict[str, Any], where: str) -> RopeConfig:
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn") and cfg.get("model_type") == "phi3":
        rope_type = "longrope"  # Phi3Config's renaming of its older spellings
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{where}.rope_type: {rope_type!r} not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError(f"{where}.partial_rotary_factor: only 1.0 is supported")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # transformers' precedence: a top-level original_max_position_embeddings (Phi-3)
    # over the rope dict's, else max_position_embeddings
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = int(original or max_pos)
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_pos / original
    factor = float(1.0 if factor is None else factor)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        max_position_embeddings=max_pos,
        attention_factor=_attention_factor(params, rope_type, factor, original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        short_factor=_factors(params, "short_factor", rope_type, where),
        long_factor=_factors(params, "long_factor", rope_type, where),
    )


def _attention_factor(params: dict[str, Any], rope_type: str, factor: float, original: int) -> float:
    """transformers' `attention_factor` for yarn and longrope (the scale of cos/sin)."""
    given = params.get("attention_factor")
    if given is not None or rope_type not in ("yarn", "longrope"):
        return float(1.0 if given is None else given)
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _factors(params: dict[str, Any], name: str, rope_type: str, where: str) -> tuple[float, ...]:
    if rope_type != "longrope":
        return ()
    values = params.get(name)
    if not isinstance(values, list) or not values:
        raise ValueError(f"{where}.{name}: longrope needs a list of numbers")
    return tuple(float(v) for v in values)


def _sliding_windows(cfg: dict[str, Any], fam: Family, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if fam.sliding == "never" or window is None:
        return (None,) * num_layers
    if fam.sliding == "flag" and not cfg.get("use_sliding_window", False):
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None and fam.sliding == "flag":
        first = int(cfg.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if layer_types is None and fam.sliding == "pattern":
        pattern = int(cfg.get("sliding_window_pattern", fam.sliding_pattern))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        layer_types = ["sliding_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types: {len(layer_types)} entries for num_hidden_layers {num_layers}")
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: size the pool from `memory_bytes` (or a default budget on CPU).
    num_blocks: int | None = None
    memory_bytes: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")


def parse_capture_sizes(text: str | Sequence[int]) -> tuple[int, ...]:
    """'1,2,4' (or a sequence) -> (1, 2, 4), sorted, unique; '' -> () (capture off)."""
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"decode_capture_sizes: expected comma-separated integers, got {text!r}") from None
    else:
        sizes = [int(s) for s in text]
    for s in sizes:
        if not 1 <= s <= 1024:
            raise ValueError(f"decode_capture_sizes: each size must be in [1, 1024], got {s}")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # Prefill chunks are cut to this many tokens when set (forces chunked prefill).
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = AUTO_DTYPE  # resolve_dtype: the checkpoint's, in what the device computes natively
    device: str = "cpu"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    max_n: int = DEFAULT_MAX_N  # upper bound for n and beam_width
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # upper bound for logprobs and prompt_logprobs
    # Speculative decoding on this engine (None: off); a dict or JSON string is parsed.
    speculative: SpeculativeConfig | None = None
    # Quantize a full-precision checkpoint while loading it (engine/quant): int8 | int4 |
    # fp8 | fp4; None keeps the checkpoint's own format (full precision, or what its
    # config.json's quantization_config declares).
    quantization: str | None = None
    # KV pages' dtype: auto (the model's) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2
    kv_cache_dtype: str = "auto"
    # vLLM's --enforce-eager: every step runs the eager forward with plain linear layers
    # (no oneDNN prepacking, engine/prepacked.py; no captured decode step).
    enforce_eager: bool = False
    # Batch sizes whose pure decode step is compiled at start-up (engine/captured.py;
    # vLLM's cudagraph_capture_sizes): a step of n sequences runs in the smallest one
    # >= n. A CPU only; each size costs seconds of start-up, so none by default.
    decode_capture_sizes: tuple[int, ...] = ()
    # The KV hierarchy below the device pool (engine/offload/; all off by default):
    # a host-memory tier of this many bytes, and a disk tier in a directory, with its
    # own byte budget; see engine/offload/config.py for each field.
    kv_offload_host_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 0
    kv_offload_persist: bool = False
    kv_offload_policy: str = "lru"
    kv_offload_disk_policy: str | None = None
    kv_offload_queue_depth: int = 256
    kv_offload_deadline: float = 5.0
    kv_offload_onload_timeout: float = 2.0
    kv_offload_fsync: bool = False
    # Structured outputs (engine/structured/): the grammar engine (xgrammar | llguidance),
    # how long a request's grammar may take to compile (seconds; then the request fails
    # with CONSTRAINT_TIMEOUT), and the largest spec (bytes: schema, regex, grammar or the
    # choices together) and JSON schema nesting admitted (deeper or larger are refused).
    structured_outputs_backend: str = "xgrammar"
    structured_outputs_compile_timeout: float = 10.0
    structured_outputs_max_bytes: int = 64 * 1024
    structured_outputs_max_depth: int = 32

    @property
    def kv_offload(self) -> bool:
        """Whether any tier below the device pool is asked for."""
        return bool(self.kv_offload_host_bytes) or self.kv_offload_dir is not None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: unknown {self.quantization!r}; choose one of {QUANTIZATION_METHODS}")
        parse_kv_cache_dtype(self.kv_cache_dtype)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative is not None:
            object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        object.__setattr__(self, "decode_capture_sizes", parse_capture_sizes(self.decode_capture_sizes))
        if self.max_n < 1:
            raise ValueError(f"max_n: must be >= 1, got {self.max_n}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be >= 0, got {self.max_logprobs}")
        check_offload_fields(self)
        check_structured_fields(self)


STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "llguidance")
STRUCTURED_FIELDS = ("structured_outputs_backend", "structured_outputs_compile_timeout",
                     "structured_outputs_max_bytes", "structured_outputs_max_depth")


def check_structured_fields(config: object) -> None:
    """The structured-outputs settings of an EngineConfig (or a worker's flags of the same
    names); ValueError naming the field."""
    backend = getattr(config, "structured_outputs_backend")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_backend: must be one of {STRUCTURED_OUTPUTS_BACKENDS}, got {backend!r}")
    timeout = getattr(config, "structured_outputs_compile_timeout")
    if not (isinstance(timeout, (int, float)) and 0 < timeout <= 3600):
        raise ValueError(f"structured_outputs_compile_timeout: must be in (0, 3600] seconds, got {timeout!r}")
    for name, cap in (("structured_outputs_max_bytes", MAX_SPEC_BYTES), ("structured_outputs_max_depth", MAX_NESTING)):
        value = getattr(config, name)
        if not (isinstance(value, int) and 1 <= value <= cap):
            raise ValueError(f"{name}: must be an integer in [1, {cap}] (the hard cap), got {value!r}")

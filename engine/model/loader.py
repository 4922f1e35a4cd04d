"""Load Hugging Face safetensors checkpoints (single file or sharded) into our model.

The architecture's model class and weight mapping come from the model registry
(engine/model/registry.py). Full-precision tensors are copied into their parameters
(q/k/v and gate/up into row ranges of the fused layers; a checkpoint that has them
fused already, Phi-3's, loads them whole). Quantization enters in one of two ways:

    online          --quantization: the full-precision model is loaded, then every
                    covered linear layer is quantized in place (engine/quant/apply.py)
    pre-quantized   config.json's quantization_config (engine/quant/checkpoint.py): the
                    covered layers are QuantLinears from the start; a module's tensors are
                    gathered, converted to the canonical storage and copied into its rows

Either way every QuantLinear is `prepare()`d for its device last, and a float8 KV
cache's per-layer scales come from `self_attn.k_scale` / `v_scale` when present.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.model import registry
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.rope import RotaryEmbedding, uses_long_factors
from pdserve.engine.quant import apply as quant_apply
from pdserve.engine.quant.checkpoint import CheckpointFormat
from pdserve.engine.quant.config import WeightScheme

log = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)

_KV_SCALES = ("self_attn.k_scale", "self_attn.v_scale")
# Older compressed-tensors checkpoints name them after the projection's output.
_OLD_KV_SCALES = {"self_attn.k_proj.output_scale": "self_attn.k_scale",
                  "self_attn.v_proj.output_scale": "self_attn.v_scale"}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors in {model_dir}")
    return files


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                scheme: WeightScheme | None, online: bool) -> LlamaForCausalLM:
    """The model with empty weights on `device` (the meta device: a skeleton that only
    counts bytes); a pre-quantized scheme's layers are QuantLinears already."""
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, device)
    rope_local = None  # Gemma 3's sliding layers' own RoPE
    if cfg.rope_local is not None:
        rope_local = RotaryEmbedding(cfg.rope_local, cfg.head_dim, max_positions, device)
    model_cls = registry.model_class(cfg.architecture)
    with torch.device("meta"):
        # cast while still on meta (free), before any QuantLinear joins: a module-wide
        # .to(dtype) would cast float8 and fp32 scale buffers too
        model = model_cls(cfg, rope, rope_local).to(dtype)
        if scheme is not None and not online:
            quant_apply.replace_linears(model, scheme, dtype)
    return model if device.type == "meta" else materialize(model, device)


def materialize(module: M, device: torch.device) -> M:
    """`module` (built on the meta device) with uninitialized tensors on `device`, as
    `Module.to_empty` gives, but without its `empty_like` of meta tensors, which imports
    sympy: ~2 s of CPU in every worker process."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str | None = None, kv_cache_dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    if uses_long_factors(cfg.rope, max_positions):
        log.warning("longrope: the long factors for every sequence (max_model_len %d > "
                    "original_max_position_embeddings %d); a max_model_len <= %d keeps the short ones "
                    "(engine/model/rope.py says why)", max_positions, cfg.rope.original_max_position_embeddings,
                    cfg.rope.original_max_position_embeddings)
    fmt, scheme = quant_apply.resolve_scheme(model_dir, quantization)
    model = build_model(cfg, dtype, device, max_positions, scheme, online=fmt is None)
    params = dict(model.named_parameters())
    params.update((n, b) for n, b in model.named_buffers() if not n.endswith("inv_freq"))
    loaded: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    kv_scales: dict[str, float] = {}
    for name, tensor in iter_tensors(model_dir):
        bare = name.removeprefix("model.")
        for old, new in _OLD_KV_SCALES.items():
            if bare.endswith(old):
                bare = bare.removesuffix(old) + new
        if bare.endswith(_KV_SCALES):
            kv_scales[bare] = float(tensor.float().reshape(-1)[0])
            continue
        if fmt is not None and fmt.owns(bare):
            module, field = fmt.split(bare)
            if quant_apply.is_quantized(model, _target(module + ".weight", cfg)[0] or ""):
                group = pending.setdefault(module, {})
                group[field] = tensor
                if fmt.complete(group):
                    _load_quantized(model, module, fmt.to_canonical(pending.pop(module), module), cfg, loaded)
                continue
            if field not in ("weight", "bias"):
                raise ValueError(f"model: {name!r} is quantized but its layer is listed under ignore")
        target, shard = _target(name, cfg)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in {cfg.architecture}")
        _copy(params[target], tensor, _shard_view(params[target], target, shard, cfg), name)
        loaded.add(target if shard is None else f"{target}#{shard}")
    if pending:
        module, group = next(iter(pending.items()))
        raise ValueError(f"model: quantized layer {module} is incomplete in the checkpoint (has {sorted(group)})")
    _check_complete(model, loaded)
    if fmt is None and scheme is not None:
        quant_apply.quantize_model(model, scheme)
    _set_kv_scales(model, kv_scales, kv_cache_dtype)
    choice = quant_apply.prepare(model)
    if choice is not None:
        log.info("%s", choice.log_line())
    return model.eval()


def _load_quantized(model: LlamaForCausalLM, module: str, canonical: dict[str, torch.Tensor], cfg: ModelConfig,
                    loaded: set[str]) -> None:
    target, shard = _target(module + ".weight", cfg)
    assert target is not None
    layer_name = target.removesuffix(".weight")
    layer = model.get_submodule(layer_name)
    own = layer.canonical()
    if set(canonical) != set(own):
        raise ValueError(f"model: {module} gives {sorted(canonical)}, the {layer.method} layer needs {sorted(own)}")
    with torch.no_grad():
        for field, tensor in canonical.items():
            full_name = f"{layer_name}.{field}"
            if field in ("perm", "input_scale"):
                first = not any(x == full_name or x.startswith(f"{full_name}#") for x in loaded)
                _load_shared(own[field], tensor, full_name, first)
            else:
                _copy(own[field], tensor, _shard_view(own[field], target, shard, cfg), f"{module}.{field}")
            loaded.add(full_name if shard is None else f"{full_name}#{shard}")


def _load_shared(dst: torch.Tensor, tensor: torch.Tensor, name: str, first: bool) -> None:
    """A per-layer value every shard of a fused layer carries: an act-order permutation
    must be the same in each (they share the input); a static input scale is the
    largest of the shards' (vLLM's rule for fused FP8 layers)."""
    if tuple(tensor.shape) != tuple(dst.shape):
        raise ValueError(f"model: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    if first:
        dst.copy_(tensor.to(dst.dtype))
    elif name.endswith("perm"):
        if not torch.equal(dst, tensor.to(dst.dtype)):
            raise ValueError(f"model: {name}: the fused shards' act-order permutations differ")
    else:
        dst.copy_(torch.maximum(dst, tensor.to(dst.dtype)))


def _set_kv_scales(model: LlamaForCausalLM, scales: dict[str, float], kv_dtype: torch.dtype | None) -> None:
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    for i, layer in enumerate(model.layers):
        k, v = scales.get(f"layers.{i}.self_attn.k_scale"), scales.get(f"layers.{i}.self_attn.v_scale")
        for name, value in (("k_scale", k), ("v_scale", v)):
            if value is not None and not (value > 0 and value < float("inf")):
                raise ValueError(f"model: layers.{i}.self_attn.{name} must be a positive finite number, got {value}")
        layer.self_attn.kv_scales = (k or 1.0, v or 1.0)
    if fp8 and len(scales) < 2 * len(model.layers):
        log.warning("kv_cache_dtype: the checkpoint has no k_scale/v_scale for %d of %d layers; using 1.0 "
                    "(values beyond the float8 range are clamped)",
                    len(model.layers) - len(scales) // 2, len(model.layers))


def _target(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    if name.endswith("rotary_emb.inv_freq"):
        return None, None
    name = name.removeprefix("model.")
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    for hf, (ours, shard) in registry.family(cfg.architecture).weights.items():
        if f".{hf}." in f".{name}":
            return name.replace(hf, ours), shard
    return name, None


def _copy(param: torch.Tensor, tensor: torch.Tensor, dst: torch.Tensor, name: str) -> None:
    with torch.no_grad():
        if dst.shape != tensor.shape:
            raise ValueError(f"model: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor.to(param.dtype))


def _shard_view(param: torch.Tensor, target: str, shard: int | None, cfg: ModelConfig) -> torch.Tensor:
    if shard is None:
        return param
    if ".gate_up_proj." in target:
        sizes = [cfg.intermediate_size] * 2
    else:
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return param.split(sizes, dim=0)[shard]


def _check_complete(model: LlamaForCausalLM, loaded: set[str]) -> None:
    missing = []
    names = [n for n, _ in model.named_parameters()]
    names += [n for n, _ in model.named_buffers() if not n.endswith("inv_freq")]
    for name in names:
        if name.endswith(("perm", "input_scale")) and (name in loaded or any(x.startswith(name + "#") for x in loaded)):
            continue
        if name in loaded:  # fused in the checkpoint already (Phi-3)
            continue
        if ".qkv_proj." in name:
            want = [f"{name}#{i}" for i in range(3)]
        elif ".gate_up_proj." in name:
            want = [f"{name}#{i}" for i in range(2)]
        else:
            want = [name]
        missing += [w for w in want if w not in loaded]
    if missing:
        raise ValueError(f"model: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")

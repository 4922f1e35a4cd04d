"""Load Hugging Face safetensors checkpoints (single file or sharded) into our model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.rope import RotaryEmbedding

# HF name suffix -> (our parameter suffix, index of the shard inside a fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


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


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, rope)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in iter_tensors(model_dir):
        target, shard = _target(name, cfg)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in {cfg.architecture}")
        _copy(params[target], tensor, _shard_view(params[target], target, shard, cfg), name)
        loaded.add(target if shard is None else f"{target}#{shard}")
    _check_complete(params, loaded)
    return model.eval()


def _target(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    if name.endswith("rotary_emb.inv_freq"):
        return None, None
    name = name.removeprefix("model.")
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    for hf, (ours, shard) in _FUSED.items():
        if f".{hf}." in f".{name}":
            return name.replace(hf, ours), shard
    return name, None


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, dst: torch.Tensor, name: str) -> None:
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


def _check_complete(params: dict[str, torch.nn.Parameter], loaded: set[str]) -> None:
    missing = []
    for name in params:
        if ".qkv_proj." in name:
            want = [f"{name}#{i}" for i in range(3)]
        elif ".gate_up_proj." in name:
            want = [f"{name}#{i}" for i in range(2)]
        else:
            want = [name]
        missing += [w for w in want if w not in loaded]
    if missing:
        raise ValueError(f"model: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")

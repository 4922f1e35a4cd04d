"""Which of a model's layers a scheme covers, and putting QuantLinears in their place.

Covered: every decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj, unless the
scheme ignores it; the LM head only when its scheme says so (online int8, whose per-row
scales also serve a tied embedding table) or a checkpoint stores it quantized.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from pdserve.engine.quant import cpu_int8
from pdserve.engine.quant.checkpoint import CheckpointFormat, detect_format
from pdserve.engine.quant.config import WeightScheme, online_scheme
from pdserve.engine.quant.linear import QuantEmbedding, QuantLinear

_LAYER_LINEARS = {
    # ours -> the Hugging Face modules it fuses
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def resolve_scheme(model_dir: Path, quantization: str | None) -> tuple[CheckpointFormat | None, WeightScheme | None]:
    """(the checkpoint's format, or None for full precision; the scheme the layers use)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    fmt = detect_format(cfg)
    if fmt is not None and quantization is not None:
        raise ValueError(f"quantization: {quantization!r} asked, but the checkpoint is already quantized "
                         f"({fmt.scheme.label}); leave --quantization unset to serve it as it is")
    if fmt is not None:
        return fmt, fmt.scheme
    return None, None if quantization is None else online_scheme(quantization)


def is_ignored(hf_module: str, scheme: WeightScheme) -> bool:
    """Whether a Hugging Face module name (with or without `model.`) stays full precision:
    an `ignore` entry names it, or is `re:<regex>` matching it (compressed-tensors' rule)."""
    names = {hf_module, hf_module.removeprefix("model."), "model." + hf_module.removeprefix("model.")}
    for entry in scheme.ignore:
        if entry.startswith("re:"):
            if any(re.match(entry[3:], n) for n in names):
                return True
        elif entry in names:
            return True
    return False


def covered(model: nn.Module, scheme: WeightScheme, online: bool) -> list[str]:
    """Our names of the linear layers `scheme` quantizes."""
    names = []
    for i in range(len(model.layers)):
        for ours, theirs in _LAYER_LINEARS.items():
            ignored = [is_ignored(f"model.layers.{i}.{t}", scheme) for t in theirs]
            if any(ignored) and not all(ignored):
                raise ValueError(f"quantization: layers.{i}.{ours} fuses {theirs}; ignoring only some of them "
                                 "is not supported")
            if not ignored[0]:
                names.append(f"layers.{i}.{ours}")
    tied = model.cfg.tie_word_embeddings
    if online:
        if scheme.quantize_lm_head:
            names.append("lm_head")
    elif not tied and not is_ignored("lm_head", scheme):
        names.append("lm_head")
    return names


def replace_linears(model: nn.Module, scheme: WeightScheme, dtype: torch.dtype) -> None:
    """Empty QuantLinears in place of the covered layers (a pre-quantized checkpoint fills them)."""
    for name in covered(model, scheme, online=False):
        old = model.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                QuantLinear(old.in_features, old.out_features, old.bias is not None, scheme, dtype))


def quantize_model(model: nn.Module, scheme: WeightScheme) -> None:
    """Online: quantize each covered full-precision layer with the scheme's quantizer."""
    for name in covered(model, scheme, online=True):
        if name == "lm_head" and model.lm_head is None:  # tied: one int8 matrix for both ends
            head = QuantLinear.from_float(model.embed_tokens.weight, scheme)
            model.lm_head = head
            model.embed_tokens = QuantEmbedding(head, model.embed_tokens.weight.dtype)
            continue
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, QuantLinear.from_float(getattr(owner, attr), scheme))


def is_quantized(model: nn.Module, param: str) -> bool:
    """Whether the module owning parameter `param` (our name) is a QuantLinear."""
    module, _, _ = param.rpartition(".")
    try:
        return isinstance(model.get_submodule(module), QuantLinear)
    except AttributeError:
        return False


def prepare(model: nn.Module) -> cpu_int8.Choice | None:
    """Every QuantLinear into its device's kernel layout; then, on a CPU with FBGEMM, the
    int8 kernel measured (cpu_int8.choose) and, where W8A8 won, the layers moved to it
    (not a tied LM head: the embedding reads its matrix). Returns the measurement (None:
    nothing to choose)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.prepare()
    tied = {id(m.head[0]) for m in model.modules() if isinstance(m, QuantEmbedding)}
    eligible = [layer for layer in layers if layer.w8a8_ready and id(layer) not in tied]
    if not eligible or not cpu_int8.available():
        return None
    probe = max(eligible, key=lambda layer: layer.in_features * layer.out_features)
    dtype = probe.bias.dtype if probe.bias is not None else next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    packed, pin = cpu_int8.pack(probe.weight, probe.weight_scale), cpu_int8.pin_row(probe.in_features)
    choice = cpu_int8.choose(probe._cpu, lambda x: cpu_int8.linear(x, packed, pin).to(x.dtype),
                             (probe.out_features, probe.in_features), dtype)
    if choice.w8a8:
        for layer in eligible:
            layer.use_w8a8()
    return choice


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage once (a tied table counts once),
    and of the int8 weights packed for FBGEMM (as the matrices they replace)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        key = id(t) if t.device.type == "meta" else t.data_ptr()
        seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
    return sum(seen.values()) + sum(m.packed_nbytes for m in model.modules() if isinstance(m, QuantLinear))

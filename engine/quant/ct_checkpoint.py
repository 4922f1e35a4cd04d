"""compressed-tensors checkpoints (what llm-compressor writes, vLLM serves) mapped onto
the canonical storage of engine/quant/formats.py.

config.json's `quantization_config` (`quant_method: compressed-tensors`) has config
groups, each a scheme for the modules it targets, stored in a `format` (per group, or
one for all). What we serve, and each module's tensors (rows: output features N,
columns: input features K):

    format               weights             activations        module tensors
    int-quantized,       int8 per channel    16-bit             weight int8 [N, K], weight_scale [N, 1] | [1]
      naive-quantized    int8 per group      16-bit             weight int8 [N, K], weight_scale [N, K/G]
                         int4 per group      16-bit             weight int8 (values -8..7), weight_scale [N, K/G]
                                                                (+ weight_zero_point [N, K/G] if asymmetric)
    pack-quantized       int8 per channel    16-bit             weight_packed int32 [N, K*bits/32], weight_scale,
                         or per group (the                      weight_shape [2]
                         W8A16 preset: 128),
                         int4 per group
                         or per channel                         (+ weight_zero_point int32 [N*4/32, K/G],
                                                                 + weight_g_idx [K] with actorder "group")
    float-quantized      fp8 per channel     fp8 per token      weight float8_e4m3fn [N, K], weight_scale [N, 1] | [1]
                         or per tensor       or static tensor   (+ input_scale [1] when static)
    nvfp4-pack-quantized fp4, fp8 scale/16   16-bit (or NVFP4:  weight_packed uint8 [N, K/2], weight_scale fp8
                                             run as 16-bit)     [N, K/16], weight_global_scale [1]
                                                                (+ input_global_scale [1] with FP4 activations)

The library's conventions (compressed_tensors 0.20: compressors/pack_quantized/helpers.py,
compressors/nvfp4/helpers.py, quantization/lifecycle/forward_helpers.py):
    pack_to_int32   value i of a row at bit 4*i (int4) / 8*i (int8) of the row's words,
                    each value stored as q + 2**(bits-1) (so a 4-bit code is our c = q + 8)
    zero points     packed the same way, but along the output rows (packed_dim=0); stored
                    zp + 8, which is our z: W = (q - zp) * s = (c - z) * s
    nvfp4           element 2j in the low nibble, bit 3 the sign; W = e2m1 * scale / global

Refused, each with a ValueError naming quantization_config and what it has: other
formats (marlin-24, sparse-*, mixed schemes), int8/int4 weights with quantized input
activations (W8A8, W4A8), asymmetric or act-ordered int8, other bit widths and
strategies (block), sparsity and transforms, output activations, and a KV cache scheme
other than FP8.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.quant.checkpoint_base import ModuleTensors, act_order_perm, per_row, unpack_int32
from pdserve.engine.quant.config import WeightScheme
from pdserve.engine.quant.formats import pack_nibbles

log = logging.getLogger(__name__)

SUPPORTED = ("int-quantized", "naive-quantized", "pack-quantized", "float-quantized", "nvfp4-pack-quantized")
_NAIVE = ("int-quantized", "naive-quantized")


@dataclass(frozen=True)
class _Storage:
    """One config group, understood: how its modules' tensors are stored."""

    format: str
    method: str  # ours: int8 | int4 | fp8 | fp4
    group_size: int | None = None  # int4, int8: None = one group per row (strategy channel or tensor)
    symmetric: bool = True
    g_idx: bool = False  # int4 with actorder "group": weight_g_idx
    static_input: bool = False  # fp8: input_scale
    input_global: bool = False  # nvfp4 with FP4 activations: input_global_scale (unused)

    @property
    def fields(self) -> frozenset[str]:
        if self.format == "nvfp4-pack-quantized":
            names = {"weight_packed", "weight_scale", "weight_global_scale"}
            return frozenset(names | ({"input_global_scale"} if self.input_global else set()))
        names = {"weight_packed", "weight_scale", "weight_shape"} if self.format == "pack-quantized" \
            else {"weight", "weight_scale"}
        if not self.symmetric:
            names.add("weight_zero_point")
        if self.g_idx:
            names.add("weight_g_idx")
        if self.static_input:
            names.add("input_scale")
        return frozenset(names)


class CompressedTensorsFormat(ModuleTensors):
    def __init__(self, storage: _Storage, ignore: tuple[str, ...]) -> None:
        self.storage = storage
        self.fields = storage.fields
        self.scheme = WeightScheme(method=storage.method, source="compressed-tensors", group_size=storage.group_size,
                                   act_order=storage.g_idx, static_input_scale=storage.static_input, ignore=ignore)

    def to_canonical(self, tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
        m = self.storage.method
        if m == "int8":
            return self._int8(tensors, module)
        if m == "int4":
            return self._int4(tensors, module)
        if m == "fp8":
            out = {"weight": tensors["weight"].to(torch.float8_e4m3fn),
                   "weight_scale": per_row(tensors["weight_scale"], tensors["weight"].shape[0], module, "weight_scale")}
            if self.storage.static_input:
                out["input_scale"] = _scalar(tensors["input_scale"], module, "input_scale")
            return out
        rows = tensors["weight_packed"].shape[0]
        return {"weight_packed": tensors["weight_packed"].to(torch.uint8),
                "weight_scale": tensors["weight_scale"].to(torch.float8_e4m3fn),
                "weight_global_scale": per_row(tensors["weight_global_scale"], rows, module, "weight_global_scale")}

    def _values(self, tensors: dict[str, torch.Tensor], bits: int, module: str) -> torch.Tensor:
        """The module's integer values, offset to unsigned codes (q + 2**(bits-1)): int32 [N, K]."""
        offset = 1 << (bits - 1)
        if self.storage.format in _NAIVE:
            return tensors["weight"].to(torch.int32) + offset
        n, k = (int(x) for x in tensors["weight_shape"].reshape(-1).tolist())
        packed = tensors["weight_packed"]
        if packed.shape[0] != n:
            raise ValueError(f"model: {module}.weight_packed has {packed.shape[0]} rows, weight_shape says {n}")
        return unpack_int32(packed, bits, k)

    def _int8(self, tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
        q = (self._values(tensors, 8, module) - 128).to(torch.int8)
        if self.storage.group_size is None:
            return {"weight": q, "weight_scale": per_row(tensors["weight_scale"], q.shape[0], module, "weight_scale")}
        n, k = q.shape
        scale = tensors["weight_scale"].float().reshape(n, -1)
        if k % scale.shape[1]:
            raise ValueError(f"model: {module}.weight_scale has {scale.shape[1]} groups for {k} inputs")
        return {"weight": q, "weight_scale": scale}

    def _int4(self, tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
        codes = self._values(tensors, 4, module)
        n, k = codes.shape
        scale = tensors["weight_scale"].float().reshape(n, -1)
        groups = scale.shape[1]
        if k % groups:
            raise ValueError(f"model: {module}.weight_scale has {groups} groups for {k} inputs")
        if self.storage.symmetric:
            zero = torch.full_like(scale, 8.0)
        elif self.storage.format in _NAIVE:
            zero = tensors["weight_zero_point"].float().reshape(n, groups) + 8.0
        else:  # packed along the rows: [ceil(N/8), groups]
            zero = unpack_int32(tensors["weight_zero_point"].t().contiguous(), 4, n).t().float()
        out = {"weight_scale": scale, "weight_zero": zero}
        if self.storage.g_idx:
            perm = act_order_perm(tensors["weight_g_idx"], k // groups, module)
            codes = codes[:, perm]
            out["perm"] = perm
        out["weight_packed"] = pack_nibbles(codes)
        return out


def _scalar(t: torch.Tensor, module: str, field: str) -> torch.Tensor:
    if t.numel() != 1:
        raise ValueError(f"model: {module}.{field} has shape {tuple(t.shape)}; expected one value per tensor")
    return t.float().reshape(())


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: compressed-tensors {what} is not supported (pdserve serves the "
                      f"formats {', '.join(SUPPORTED)}: int8 or int4 weights with 16-bit activations, FP8 weights "
                      "with FP8 activations per token or static per tensor, NVFP4 weights)")


def parse(qc: dict[str, Any]) -> CompressedTensorsFormat:
    """The format a compressed-tensors quantization_config declares, or a ValueError."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status {status!r} (weights saved uncompressed)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _refuse(f"sparsity_config with format {sparsity.get('format')!r}")
    if qc.get("transform_config"):
        raise _refuse("transform_config (rotated weights)")
    _check_kv_cache_scheme(qc.get("kv_cache_scheme"))
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("a config without config_groups")
    default_format = qc.get("format")
    kinds = {_group_storage(name, group, default_format) for name, group in groups.items()}
    if len(kinds) > 1:
        raise _refuse(f"several config groups with different schemes ({sorted(groups)}, format "
                      f"{default_format!r})")
    storage = kinds.pop()
    if storage.input_global:
        log.warning("quantization: NVFP4 checkpoint with FP4 activations; serving it weight-only (activations stay "
                    "16-bit), as vLLM does on GPUs without FP4 tensor cores")
    return CompressedTensorsFormat(storage, tuple(qc.get("ignore") or ()))


def _check_kv_cache_scheme(kv: dict[str, Any] | None) -> None:
    """An FP8 KV cache scheme is fine: its scales are the layers' self_attn.k_scale / v_scale,
    which the loader reads; the KV dtype itself is the user's --kv-cache-dtype."""
    if kv and not (kv.get("type") == "float" and kv.get("num_bits") == 8):
        raise _refuse(f"kv_cache_scheme {kv.get('type')!r} with num_bits {kv.get('num_bits')!r} (FP8 only)")


def _group_storage(name: str, group: Any, default_format: str | None) -> _Storage:
    if not isinstance(group, dict):
        raise _refuse(f"config group {name!r} given as {group!r} (a preset name, not a saved scheme)")
    fmt = group.get("format") or default_format
    where = f"format {fmt!r} (config group {name!r})"
    if fmt not in SUPPORTED:
        raise _refuse(where)
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise _refuse(f"{where} with targets {targets} (only 'Linear': every linear layer but those ignored)")
    w, act = group.get("weights"), group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse(f"{where} with quantized output activations")
    if not w:
        raise _refuse(f"{where} without quantized weights")
    if w.get("dynamic"):
        raise _refuse(f"{where} with dynamic weight scales")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    symmetric = w.get("symmetric", True)
    desc = f"{where}: {kind} weights, num_bits {bits}, strategy {strategy!r}"
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        return _fp8(desc, strategy, symmetric, act)
    if fmt == "nvfp4-pack-quantized" and kind == "float" and bits == 4:
        if strategy != "tensor_group" or w.get("group_size") != 16 or not symmetric:
            raise _refuse(f"{desc}, group_size {w.get('group_size')} (NVFP4: symmetric tensor_group of 16)")
        if act and not (act.get("type") == "float" and act.get("num_bits") == 4):
            raise _refuse(f"{desc} with {act.get('type')} {act.get('num_bits')}-bit activations")
        return _Storage(fmt, "fp4", input_global=bool(act) and act.get("dynamic") is not True)
    if fmt in (*_NAIVE, "pack-quantized") and kind == "int":
        if act:
            raise _refuse(f"{desc} with {act.get('type')} {act.get('num_bits')}-bit input activations "
                          f"(W{bits}A{act.get('num_bits')}; weight-only int8/int4 is served)")
        if bits == 8 and strategy in ("channel", "tensor", "group") and symmetric:
            return _int8(fmt, desc, strategy, w)
        if bits == 4 and strategy in ("group", "channel"):
            actorder = w.get("actorder")
            if actorder not in (None, "weight", "group", "dynamic", True):
                raise _refuse(f"{desc} with actorder {actorder!r}")
            group_size = w.get("group_size") if strategy == "group" else None
            g_idx = actorder in ("group", "dynamic", True)
            if g_idx and group_size is None:
                raise _refuse(f"{desc} with actorder {actorder!r} and no groups")
            return _Storage(fmt, "int4", group_size=group_size, symmetric=bool(symmetric), g_idx=g_idx)
        raise _refuse(f"{desc}, symmetric {symmetric} (int8: symmetric per channel, tensor or group; int4: per "
                      "group or channel)")
    raise _refuse(desc)


def _int8(fmt: str, desc: str, strategy: str, w: dict[str, Any]) -> _Storage:
    """Symmetric int8: per channel or tensor (one scale per row, as we store it) or per
    group (llm-compressor's W8A16 preset). No act order: its g_idx would permute int8
    groups, which nothing here serves."""
    group_size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise _refuse(f"{desc}, group_size {group_size!r}")
    if w.get("actorder") not in (None, "weight"):
        raise _refuse(f"{desc} with actorder {w.get('actorder')!r} (int8: no act order)")
    return _Storage(fmt, "int8", group_size=group_size)


def _fp8(desc: str, strategy: str | None, symmetric: bool, act: dict[str, Any] | None) -> _Storage:
    if strategy not in ("channel", "tensor") or not symmetric:
        raise _refuse(f"{desc} (FP8 weights: symmetric per channel or per tensor)")
    if not act or act.get("type") != "float" or act.get("num_bits") != 8:
        got = "16-bit activations" if not act else f"{act.get('type')} {act.get('num_bits')}-bit activations"
        raise _refuse(f"{desc} with {got} (FP8 weights need FP8 activations)")
    dynamic, a_strategy = act.get("dynamic"), act.get("strategy")
    if dynamic is True and a_strategy == "token":
        return _Storage("float-quantized", "fp8")
    if dynamic is False and a_strategy == "tensor":
        return _Storage("float-quantized", "fp8", static_input=True)
    raise _refuse(f"{desc} with FP8 activations dynamic={dynamic!r}, strategy {a_strategy!r} (per token dynamic "
                  "or per tensor static)")

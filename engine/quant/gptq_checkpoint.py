"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum) mapped onto int4's canonical storage.

config.json: `quant_method: gptq`, `bits: 4`, `group_size` (-1: one group per row),
`desc_act` (act order), `sym`, `lm_head` (quantized too; default no),
`checkpoint_format` ("gptq", the classic v1, or "gptq_v2"). Each module, of N outputs
and K inputs, G = group_size:

    qweight  int32 [K/8, N]    eight 4-bit codes per word along K: input k of output n
                               is bits 4*(k%8) .. of qweight[k/8, n]
    qzeros   int32 [K/G, N/8]  eight zero points per word along N, the same way
    scales   fp16  [K/G, N]
    g_idx    int32 [K]         the group of input k (k // G without act order)

    W[n, k] = (code - zero) * scale, zero and scale of group g_idx[k]

v1 stores each zero point minus one (AutoGPTQ's pack: `zeros -= 1`, and its dequantize
adds the one back after masking to 4 bits, so a stored 0xF reads as 16); gptq_v2 stores
them as they are. Act order: the permutation sorting g_idx makes each group's columns
contiguous, which is our canonical `perm` (stored column j is input column perm[j]).
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.quant.checkpoint_base import ModuleTensors, act_order_perm, unpack_int32
from pdserve.engine.quant.config import WeightScheme
from pdserve.engine.quant.formats import pack_nibbles

_FORMATS = ("gptq", "gptq_v2")


class GPTQFormat(ModuleTensors):
    fields = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, group_size: int | None, act_order: bool, v2: bool, quantize_lm_head: bool) -> None:
        self.v2 = v2
        self.scheme = WeightScheme(method="int4", source="gptq", group_size=group_size, act_order=act_order,
                                   ignore=() if quantize_lm_head else ("lm_head",))

    def to_canonical(self, tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
        qweight, scales = tensors["qweight"], tensors["scales"]
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        groups = scales.shape[0]
        if scales.shape[1] != n or k % groups:
            raise ValueError(f"model: {module}: scales {tuple(scales.shape)} do not fit qweight {tuple(qweight.shape)}")
        codes = unpack_int32(qweight.t().contiguous(), 4, k)  # [N, K]
        zero = unpack_int32(tensors["qzeros"], 4, n).t().float()  # [N, groups]
        if not self.v2:
            zero = zero + 1.0
        out = {"weight_scale": scales.t().float().contiguous(), "weight_zero": zero.contiguous()}
        g_idx = tensors["g_idx"]
        if self.scheme.act_order:
            out["perm"] = act_order_perm(g_idx, k // groups, module)
            codes = codes[:, out["perm"]]
        elif not torch.equal(g_idx.to(torch.int64).reshape(-1), torch.arange(k) // (k // groups)):
            raise ValueError(f"model: {module}: g_idx is not in group order, but quantization_config has "
                             "desc_act false")
        out["weight_packed"] = pack_nibbles(codes)
        return out


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: gptq {what} is not supported (pdserve serves 4-bit GPTQ, "
                      f"checkpoint_format {' or '.join(_FORMATS)}, with or without desc_act)")


def parse(qc: dict[str, Any]) -> GPTQFormat:
    bits = qc.get("bits")
    if bits != 4:
        raise _refuse(f"bits {bits!r}")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in _FORMATS:
        raise _refuse(f"checkpoint_format {fmt!r}")
    if qc.get("dynamic"):
        raise _refuse("with per-module overrides (dynamic)")
    if qc.get("modules_in_block_to_quantize"):
        raise _refuse("with modules_in_block_to_quantize (some layers left in full precision)")
    group_size = qc.get("group_size", 128)
    if group_size == -1:
        group_size = None
    elif not isinstance(group_size, int) or group_size <= 0:
        raise _refuse(f"group_size {group_size!r}")
    return GPTQFormat(group_size, bool(qc.get("desc_act", False)), fmt == "gptq_v2", bool(qc.get("lm_head", False)))

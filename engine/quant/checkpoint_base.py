"""What every pre-quantized checkpoint format shares: which tensors are a quantized
module's, when a module has them all, and unpacking int32 words.

A format names, per quantized module, the exact set of tensors the checkpoint holds
for it (its `fields`); the loader gathers them, whatever order the shards list them
in, until the set is complete, then asks the format for the canonical storage:

    layers.0.self_attn.q_proj.weight_packed  -> ("layers.0.self_attn.q_proj", "weight_packed")
    layers.0.self_attn.q_proj.weight_scale   -> ...                  complete -> to_canonical
    layers.0.self_attn.q_proj.bias           -> not owned: full precision
    layers.0.input_layernorm.weight          -> not owned: not a linear layer
    lm_head.weight (listed under ignore)     -> the loader sees its layer is full precision
"""

from __future__ import annotations

import torch

from pdserve.engine.quant.config import WeightScheme

# The Hugging Face linear layers a checkpoint may store quantized (last name part).
LINEAR_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class ModuleTensors:
    """owns / split / complete for a format whose quantized modules each carry `fields`."""

    scheme: WeightScheme
    fields: frozenset[str]

    def owns(self, name: str) -> bool:
        module, _, field = name.rpartition(".")
        if field not in self.fields or not module:
            return False
        # an ignored layer's `weight` is owned too: the loader sends it the full-precision way
        return module.rpartition(".")[2] in LINEAR_NAMES or module == "lm_head"

    def split(self, name: str) -> tuple[str, str]:
        module, _, field = name.rpartition(".")
        return module, field

    def complete(self, tensors: dict[str, torch.Tensor]) -> bool:
        return self.fields <= tensors.keys()


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [R, W] words, `32 // bits` values each, value i of a word in bits
    [bits*i, bits*(i+1)) (the low bits first) -> int32 [R, count] unsigned values.

    GPTQ and compressed-tensors' pack-quantized both pack this way (for 4 and 8 bits no
    value straddles two words); shifts, not a byte view, so the host's byte order does
    not matter."""
    if 32 % bits:
        raise ValueError(f"quantization: {bits}-bit values do not divide an int32 word")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)
    if values.shape[-1] < count:
        raise ValueError(f"quantization: {packed.shape[-1]} packed words hold {values.shape[-1]} values, "
                         f"{count} expected")
    return values[..., :count]


def act_order_perm(g_idx: torch.Tensor, group_size: int, module: str) -> torch.Tensor:
    """GPTQ's act order: input column k belongs to group g_idx[k]. The permutation that
    makes groups contiguous (stored column j is input column perm[j]); each group must
    then hold exactly `group_size` columns, as GPTQ's quantizer makes them."""
    g = g_idx.to(torch.int64).reshape(-1)
    perm = torch.argsort(g, stable=True)
    want = torch.arange(g.numel()) // group_size
    if not torch.equal(g[perm], want):
        raise ValueError(f"model: {module}: g_idx does not split the inputs into groups of {group_size}")
    return perm


def per_row(scale: torch.Tensor, rows: int, module: str, field: str) -> torch.Tensor:
    """A per-channel ([N, 1] or [N]) or per-tensor ([1] or []) scale -> fp32 [N]."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"model: {module}.{field} has shape {tuple(scale.shape)}; expected one value per "
                         f"output channel ({rows}) or one per tensor")
    return s

"""Comparing a quantized model's greedy output with full precision's, vLLM's way.

`check_logprobs_close` is vLLM's criterion (tests/models/utils.py there): two greedy
runs of the same prompt may pick different tokens only where each side's token is
among the other side's top logprobs at that position; after the first such
divergence the sequences' contexts differ, so nothing later is compared.

    position:    0   1   2   3 ...
    run A:       t0  t1  a2  (not compared)
    run B:       t0  t1  b2  (not compared)
                         ^ a2 in B's top-k at 2 and b2 in A's top-k at 2, else a failure
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# One greedy sample: its tokens and, per position, {token id: logprob} of its top k.
Sample = tuple[Sequence[int], Sequence[Mapping[int, float]]]


def check_logprobs_close(outputs_0: Sequence[Sample], outputs_1: Sequence[Sample], name_0: str, name_1: str) -> None:
    """Raise AssertionError naming the prompt and position where the runs part in a
    way the criterion refuses (a token outside the other's top logprobs)."""
    assert len(outputs_0) == len(outputs_1), f"{name_0}: {len(outputs_0)} outputs, {name_1}: {len(outputs_1)}"
    for prompt, ((ids_0, lps_0), (ids_1, lps_1)) in enumerate(zip(outputs_0, outputs_1)):
        for pos, (a, b) in enumerate(zip(ids_0, ids_1)):
            if a == b:
                continue
            assert a in lps_1[pos], (f"prompt {prompt}, position {pos}: {name_0} picked {a}, not in {name_1}'s top "
                                     f"{sorted(lps_1[pos], key=lps_1[pos].get, reverse=True)} (it picked {b})")
            assert b in lps_0[pos], (f"prompt {prompt}, position {pos}: {name_1} picked {b}, not in {name_0}'s top "
                                     f"{sorted(lps_0[pos], key=lps_0[pos].get, reverse=True)} (it picked {a})")
            break  # the contexts differ from here on


def first_divergence(outputs_0: Sequence[Sample], outputs_1: Sequence[Sample]) -> list[int | None]:
    """Per prompt, the first position where the two runs' tokens differ (None: never)."""
    return [next((i for i, (a, b) in enumerate(zip(x[0], y[0])) if a != b), None)
            for x, y in zip(outputs_0, outputs_1)]


def dequantized_hf(model: Any, method: str) -> Any:
    """`model` (transformers, in place) with every layer the online scheme `method`
    covers replaced by its quantized-then-dequantized weight, shards the engine fuses
    (q/k/v, gate/up) quantized together as the loader fuses them: the weights the
    engine's quantized model computes with, for transformers to run as the reference."""
    import torch

    from pdserve.engine.quant import formats
    from pdserve.engine.quant.config import online_scheme
    from pdserve.engine.quant.linear import layer_group_size

    scheme = online_scheme(method)

    def replace(modules: list[Any]) -> None:
        fused = torch.cat([m.weight.detach().float() for m in modules])
        group = layer_group_size(scheme, fused.shape[1])
        deq = formats.dequantize(method, formats.quantize(method, fused, group), group)
        for m, w in zip(modules, deq.split([m.weight.shape[0] for m in modules])):
            m.weight.copy_(w)

    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                          [mlp.down_proj]):
                replace(group)
        if scheme.quantize_lm_head:  # a tied table is the same tensor: both ends change
            replace([model.lm_head])
    return model

"""GPTQ checkpoints (tests/quant_checkpoints.py: AutoGPTQ's layout, v1 and v2 zero points,
with and without act order) served by the engine.

  - our canonical weights, dequantized, equal the values the checkpoint was packed from
    (which AutoGPTQ's own CPU dequantize returns for the same bytes: checked when the
    packer was written, see tests/quant_checkpoints.py),
  - the engine loads it into int4 QuantLinears (act order: one permutation per fused
    layer) and its greedy tokens pass vLLM's check_logprobs_close against transformers
    running the dequantized weights, on Llama, Qwen2 and Mistral.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pdserve.engine import LLM
from pdserve.engine.quant import formats
from pdserve.engine.quant.checkpoint import detect_format
from pdserve.engine.quant.gptq_checkpoint import GPTQFormat
from pdserve.engine.quant.linear import QuantLinear, layer_group_size
from tests.quant_checkpoints import (
    build_gptq_checkpoint,
    engine_greedy,
    gptq_pack_spec,
    gptq_quantize,
    hf_greedy_logprobs,
)
from tests.quant_models import check_logprobs_close

# name: (architecture, group_size, desc_act, sym, gptq_v2, our scheme's label)
CASES = {
    "llama-g128": ("llama", 128, False, True, False, "int4/gptq/g128"),
    "qwen2-g32-act-order": ("qwen2", 32, True, True, False, "int4/gptq/g32/act_order"),
    "mistral-g64-asym-act-order": ("mistral", 64, True, False, False, "int4/gptq/g64/act_order"),
    "llama-v2-asym": ("llama", 128, False, False, True, "int4/gptq/g128"),
    "qwen2-per-channel": ("qwen2", -1, False, True, False, "int4/gptq"),
}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64], [200, 13, 77, 8, 150, 31], list(range(10, 40, 3))]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, group, act_order, sym, v2, _ = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf, dense = build_gptq_checkpoint(path, arch, group_size=group,
                                      desc_act=act_order, sym=sym, v2=v2, seed=sorted(CASES).index(request.param))
    return request.param, path, hf, dense


def test_dequantized_weights_equal_the_packed_values(checkpoint) -> None:
    name, path, _, dense = checkpoint
    fmt = detect_format(json.loads((path / "config.json").read_text()))
    assert isinstance(fmt, GPTQFormat) and fmt.scheme.label == CASES[name][-1]
    groups: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for tensor_name in f.keys():
            bare = tensor_name.removeprefix("model.")
            if fmt.owns(bare):
                module, field = fmt.split(bare)
                groups.setdefault(module, {})[field] = f.get_tensor(tensor_name)
    assert len(groups) == len(dense)
    for module, tensors in groups.items():
        assert fmt.complete(tensors)
        canonical = fmt.to_canonical(tensors, module)
        assert ("perm" in canonical) == fmt.scheme.act_order
        ref = dense[f"model.{module}"]
        ours = formats.dequantize("int4", canonical, layer_group_size(fmt.scheme, ref.shape[1]))
        torch.testing.assert_close(ours, ref, rtol=0, atol=0, msg=f"{name}: {module}")


def test_engine_serves_it_close_to_transformers(checkpoint) -> None:
    name, path, hf, _ = checkpoint
    ours = engine_greedy(path, PROMPTS, MAX_TOKENS)
    check_logprobs_close(hf_greedy_logprobs(hf, PROMPTS, MAX_TOKENS), ours, f"transformers {name}", f"pdserve {name}")


def test_act_order_layers_carry_the_permutation(tmp_path: Path) -> None:
    build_gptq_checkpoint(tmp_path, "llama", group_size=32, desc_act=True)
    model = LLM(model=str(tmp_path), num_blocks=16).engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.scheme.act_order
    assert sorted(qkv.perm.tolist()) == list(range(qkv.in_features))
    assert not torch.equal(qkv.perm, torch.arange(qkv.in_features))
    assert not isinstance(model.lm_head, QuantLinear)  # lm_head: false


def test_fused_shards_with_different_permutations_are_refused(tmp_path: Path) -> None:
    """q/k/v share their input, so their act-order permutations must agree (the loader's
    check); a checkpoint whose k_proj was permuted otherwise is refused, not mixed up."""
    from safetensors.torch import load_file, save_file

    build_gptq_checkpoint(tmp_path, "llama", group_size=32, desc_act=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"
    k, n = state[f"{name}.g_idx"].numel(), state[f"{name}.scales"].shape[1]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(9)) * 0.05
    state.update({f"{name}.{f}": t for f, t in gptq_pack_spec(gptq_quantize(w, 32, True, True, seed=99)).items()})
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="act-order permutations differ"):
        LLM(model=str(tmp_path), num_blocks=16)


def test_v1_zero_points_are_stored_minus_one() -> None:
    """AutoGPTQ's v1 quirk: zero z is stored as z - 1 masked to 4 bits, so z = 0 reads
    back as 16 (0xF + 1): what AutoGPTQ's dequantize computes, and what we must too."""
    q = gptq_quantize(torch.randn(8, 128) * 0.05, 128, False, False, seed=0)
    q["zeros"][0, 0] = 0.0
    packed = gptq_pack_spec(q)
    assert packed["qzeros"][0, 0].item() & 0xF == 0xF
    canonical = GPTQFormat(128, False, False, False).to_canonical(packed, "m")
    assert canonical["weight_zero"][0, 0].item() == 16.0
    assert canonical["weight_zero"][1:, 0].tolist() == q["zeros"][1:, 0].tolist()

"""compressed-tensors checkpoints written by the library itself (tests/quant_checkpoints.py),
served by the engine.

For each format the library writes, on small random Llama, Qwen2 and Mistral models:
  - the library wrote what we expect (its format name and tensor names),
  - our canonical weights, dequantized, equal compressed-tensors' own decompression
    (transformers loading the checkpoint with `dequantize=True`),
  - the engine loads it into QuantLinears of the right scheme and its greedy tokens
    pass vLLM's check_logprobs_close against transformers on the decompressed model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import preset_name_to_scheme
from safetensors import safe_open

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.memory import plan_memory
from pdserve.engine.quant import formats
from pdserve.engine.quant.checkpoint import detect_format
from pdserve.engine.quant.linear import QuantLinear, layer_group_size
from tests.quant_checkpoints import build_ct_checkpoint, engine_greedy, hf_decompressed, hf_greedy_logprobs
from tests.quant_models import check_logprobs_close

W8_CHANNEL = dict(num_bits=8, type="int", strategy="channel", symmetric=True)
W8A16 = preset_name_to_scheme("W8A16", ["Linear"]).weights.model_dump()  # the library's: int8 per group of 128
W8_GROUP32 = dict(num_bits=8, type="int", strategy="group", group_size=32, symmetric=True)
W4_GROUP = dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=True)
W4_ASYM = dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=False)
W4_CHANNEL = dict(num_bits=4, type="int", strategy="channel", symmetric=True)
FP8_CHANNEL = dict(num_bits=8, type="float", strategy="channel", symmetric=True)
FP8_TENSOR = dict(num_bits=8, type="float", strategy="tensor", symmetric=True)
FP8_PER_TOKEN = dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
FP8_STATIC = dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
NVFP4 = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
             scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn)  # the library's NVFP4A16 preset

# name: (architecture, weights, input activations, forced format, the format written,
#        q_proj's tensors in the file, our scheme's label); a case's seed is its place in
#        the sorted names, so a new name sorts after the others
CASES = {
    "w8a16-int-quantized-llama": ("llama", W8_CHANNEL, None, "int-quantized", "int-quantized",
                                  {"weight", "weight_scale"}, "int8/compressed-tensors"),
    "w8a16-pack-quantized-qwen2": ("qwen2", W8_CHANNEL, None, None, "pack-quantized",
                                   {"weight_packed", "weight_scale", "weight_shape"}, "int8/compressed-tensors"),
    "w4a16-llama": ("llama", W4_GROUP, None, None, "pack-quantized",
                    {"weight_packed", "weight_scale", "weight_shape"}, "int4/compressed-tensors/g128"),
    "w4a16-qwen2": ("qwen2", W4_GROUP, None, None, "pack-quantized",
                    {"weight_packed", "weight_scale", "weight_shape"}, "int4/compressed-tensors/g128"),
    "w4a16-asym-mistral": ("mistral", W4_ASYM, None, None, "pack-quantized",
                           {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"},
                           "int4/compressed-tensors/g128"),
    "w4a16-channel-llama": ("llama", W4_CHANNEL, None, None, "pack-quantized",
                            {"weight_packed", "weight_scale", "weight_shape"}, "int4/compressed-tensors"),
    "fp8-dynamic-mistral": ("mistral", FP8_CHANNEL, FP8_PER_TOKEN, None, "float-quantized",
                            {"weight", "weight_scale"}, "fp8/compressed-tensors"),
    "fp8-dynamic-qwen2": ("qwen2", FP8_CHANNEL, FP8_PER_TOKEN, None, "float-quantized",
                          {"weight", "weight_scale"}, "fp8/compressed-tensors"),
    "fp8-static-llama": ("llama", FP8_TENSOR, FP8_STATIC, None, "float-quantized",
                         {"weight", "weight_scale", "input_scale"}, "fp8/compressed-tensors/static"),
    "nvfp4a16-mistral": ("mistral", NVFP4, None, None, "nvfp4-pack-quantized",
                         {"weight_packed", "weight_scale", "weight_global_scale"}, "fp4/compressed-tensors"),
    "nvfp4a16-llama": ("llama", NVFP4, None, None, "nvfp4-pack-quantized",
                       {"weight_packed", "weight_scale", "weight_global_scale"}, "fp4/compressed-tensors"),
    # W8A16 as llm-compressor writes it today: 8-bit pack-quantized, groups of 128 (one
    # group in q_proj's 128 inputs, two in down_proj's 256); g32 has four to eight
    "w8g128-llama": ("llama", W8A16, None, None, "pack-quantized",
                     {"weight_packed", "weight_scale", "weight_shape"}, "int8/compressed-tensors/g128"),
    "w8g128-qwen2": ("qwen2", W8A16, None, None, "pack-quantized",
                     {"weight_packed", "weight_scale", "weight_shape"}, "int8/compressed-tensors/g128"),
    "w8g32-int-quantized-mistral": ("mistral", W8_GROUP32, None, "int-quantized", "int-quantized",
                                    {"weight", "weight_scale"}, "int8/compressed-tensors/g32"),
}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64], [200, 13, 77, 8, 150, 31], list(range(10, 40, 3))]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, weights, acts, fmt, *_ = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    build_ct_checkpoint(path, arch, weights, acts, fmt, seed=sorted(CASES).index(request.param))
    return request.param, path, hf_decompressed(path)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name.removeprefix("model."): f.get_tensor(name) for name in f.keys()}


def test_the_library_wrote_the_format(checkpoint) -> None:
    name, path, _ = checkpoint
    *_, written, fields, label = CASES[name]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", written, ["lm_head"])
    tensors = checkpoint_tensors(path)
    assert {n.rpartition(".")[2] for n in tensors if n.startswith("layers.0.self_attn.q_proj.")} - {"bias"} == fields
    assert "lm_head.weight" in tensors and tensors["lm_head.weight"].dtype == torch.float32
    assert detect_format({"quantization_config": qc}).scheme.label == label


def test_dequantized_weights_equal_the_library_decompression(checkpoint) -> None:
    name, path, hf = checkpoint
    fmt = detect_format(json.loads((path / "config.json").read_text()))
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in checkpoint_tensors(path).items():
        if fmt.owns(tensor_name) and not tensor_name.startswith("lm_head."):
            module, field = fmt.split(tensor_name)
            groups.setdefault(module, {})[field] = tensor
    reference = hf.state_dict()
    assert len(groups) == 7 * hf.config.num_hidden_layers
    for module, tensors in groups.items():
        assert fmt.complete(tensors)
        ref = reference[f"model.{module}.weight"].float()
        ours = formats.dequantize(fmt.scheme.method, fmt.to_canonical(tensors, module),
                                  layer_group_size(fmt.scheme, ref.shape[1]))
        # the library decompresses NVFP4 in bfloat16, everything else in float32
        rtol = 2**-8 if fmt.scheme.method == "fp4" else 0.0
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=1e-12, msg=f"{name}: {module}")


def test_engine_serves_it_close_to_transformers(checkpoint) -> None:
    name, path, hf = checkpoint
    label = CASES[name][-1]
    ours = engine_greedy(path, PROMPTS, MAX_TOKENS)
    check_logprobs_close(hf_greedy_logprobs(hf, PROMPTS, MAX_TOKENS), ours, f"transformers {name}", f"pdserve {name}")


def test_engine_layers_hold_the_checkpoint_scheme(tmp_path: Path) -> None:
    build_ct_checkpoint(tmp_path, "qwen2", W4_GROUP)
    model = LLM(model=str(tmp_path), num_blocks=16).engine.runner.model
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert sorted(quantized) == sorted(f"layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    assert {m.scheme.label for m in quantized.values()} == {"int4/compressed-tensors/g128"}
    assert quantized["layers.0.self_attn.qkv_proj"].bias is not None  # Qwen2's biases stay full precision
    assert not isinstance(model.lm_head, QuantLinear)


def test_w8a16_groups_load_as_planned(tmp_path: Path) -> None:
    """The library's W8A16 (int8 per group of 128): the layers keep one scale per group
    of 128 (two in down_proj), and the memory plan, built on the meta device, counts
    exactly the loaded model's bytes."""
    build_ct_checkpoint(tmp_path, "llama", W8A16)
    llm = LLM(model=str(tmp_path), num_blocks=16)
    model = llm.engine.runner.model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.scheme.label == "int8/compressed-tensors/g128"
    assert down.group_size == 128 and down._group_scales.shape == (2, 128)  # [K/G, N] once prepared for the CPU
    plan = plan_memory(str(tmp_path), num_blocks=16)
    loaded = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}.values()
    assert plan.weight_bytes == llm.engine.memory.weight_bytes == sum(t.numel() * t.element_size() for t in loaded)


def test_ignored_layers_stay_full_precision(tmp_path: Path) -> None:
    """`ignore` holds module names and `re:` regexes, as the library matches them."""
    hf_model = build_ct_checkpoint(tmp_path, "llama", W8_CHANNEL, fmt="int-quantized",
                                   ignore=("lm_head", "re:.*mlp.down_proj$", "model.layers.1.self_attn.o_proj"))
    model = LLM(model=str(tmp_path), num_blocks=16).engine.runner.model
    for i in range(2):
        assert not isinstance(model.layers[i].mlp.down_proj, QuantLinear)
        torch.testing.assert_close(model.layers[i].mlp.down_proj.weight, hf_model.model.layers[i].mlp.down_proj.weight)
    assert isinstance(model.layers[0].self_attn.o_proj, QuantLinear)
    assert not isinstance(model.layers[1].self_attn.o_proj, QuantLinear)
    assert isinstance(model.layers[1].mlp.gate_up_proj, QuantLinear)


def test_fp8_kv_cache_scales_come_from_the_kv_cache_scheme(tmp_path: Path) -> None:
    kv = dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    build_ct_checkpoint(tmp_path, "llama", FP8_CHANNEL, FP8_PER_TOKEN, kv_cache_scheme=kv)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
    names = set(checkpoint_tensors(tmp_path))
    assert {"layers.1.self_attn.k_scale", "layers.1.self_attn.v_scale"} <= names  # where the library puts them
    llm = LLM(model=str(tmp_path), num_blocks=16, kv_cache_dtype="fp8")
    scales = [layer.self_attn.kv_scales for layer in llm.engine.runner.model.layers]
    assert scales == [pytest.approx((0.01, 0.02)), pytest.approx((0.02, 0.04))]
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)

"""Every quantization_config we do not serve is a ValueError naming quantization_config
and what it declares, never a silent full-precision load. The compressed-tensors
configs come from the library: its presets, saved in the format it would choose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, preset_name_to_scheme
from torch import nn

from pdserve.engine import LLM
from pdserve.engine.quant.checkpoint import detect_format
from tests.hf_models import build_model


def library_config(preset: str, **extra: Any) -> dict[str, Any]:
    """config.json's quantization_config as compressed-tensors writes it for `preset`."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    fmt = infer_module_format(nn.Linear, scheme).value
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                            quantization_status="compressed", **extra)
    return {"quant_method": "compressed-tensors", **json.loads(qc.model_dump_json())}


# preset -> what the message must name
LIBRARY_REFUSALS = {
    "W8A8": ("int-quantized", "W8A8"),
    "W4A8": ("pack-quantized", "W4A8"),
    "W4AFP8": ("float 8-bit input activations",),
    "W3A16": ("num_bits 3",),
    "FP8_BLOCK": ("strategy 'block'",),
    "MXFP4A16": ("mxfp4-pack-quantized",),
    "MXFP8": ("mxfp8-quantized",),
}


@pytest.mark.parametrize("preset", list(LIBRARY_REFUSALS))
def test_library_presets_we_do_not_serve_are_refused(preset: str) -> None:
    with pytest.raises(ValueError, match="quantization_config: compressed-tensors") as info:
        detect_format({"quantization_config": library_config(preset)})
    for needle in LIBRARY_REFUSALS[preset]:
        assert needle in str(info.value)


def ct(**changes: Any) -> dict[str, Any]:
    """A served config (W4A16) with some fields changed."""
    return {**library_config("W4A16"), **changes}


def w8a16_weights(**changes: Any) -> dict[str, Any]:
    """The library's W8A16 config (int8 per group of 128, served) with its weights' args changed."""
    qc = library_config("W8A16")
    group = qc["config_groups"]["group_0"]
    return {**qc, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **changes}}}}


HAND_REFUSALS = {
    "marlin-24": (ct(format="marlin-24", config_groups={
        "group_0": {**library_config("W4A16")["config_groups"]["group_0"], "format": "marlin-24"}}), "marlin-24"),
    "sparse": (ct(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
               "sparse-24-bitmask"),
    "transform": (ct(transform_config={"config_groups": {"u": {"type": "hadamard"}}}), "transform_config"),
    "frozen": (ct(quantization_status="frozen"), "quantization_status 'frozen'"),
    "targets": (ct(config_groups={"group_0": {**library_config("W4A16")["config_groups"]["group_0"],
                                              "targets": ["re:.*mlp.*"]}}), "targets"),
    "preset-form": (ct(config_groups={"W4A16": ["Linear"]}), "preset name"),
    "mixed": (ct(format="mixed-precision", config_groups={
        "group_0": {**library_config("W4A16")["config_groups"]["group_0"], "format": "pack-quantized"},
        "group_1": {**library_config("FP8_DYNAMIC")["config_groups"]["group_0"], "format": "float-quantized"}}),
        "different schemes"),
    "output-activations": (ct(config_groups={"group_0": {
        **library_config("W4A16")["config_groups"]["group_0"],
        "output_activations": QuantizationArgs(num_bits=8, type="float").model_dump(mode="json")}}),
        "output activations"),
    "kv-int8": (library_config("W4A16", kv_cache_scheme=QuantizationArgs(num_bits=8, type="int")), "kv_cache_scheme"),
    "int8-asymmetric": (w8a16_weights(symmetric=False), "symmetric False"),
    "int8-act-order": (w8a16_weights(actorder="group"), "actorder 'group'"),
    "fp8-weight-only": (ct(format="float-quantized", config_groups={"group_0": json.loads(QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", strategy="channel"),
        format="float-quantized").model_dump_json())}), "16-bit activations"),
}


@pytest.mark.parametrize("case", list(HAND_REFUSALS))
def test_other_compressed_tensors_configs_are_refused(case: str) -> None:
    qc, needle = HAND_REFUSALS[case]
    with pytest.raises(ValueError, match="quantization_config: compressed-tensors") as info:
        detect_format({"quantization_config": qc})
    assert needle in str(info.value)


OTHER_METHODS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8"},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}


@pytest.mark.parametrize("method", list(OTHER_METHODS))
def test_other_quant_methods_are_refused(method: str) -> None:
    with pytest.raises(ValueError, match=f"quantization_config: quant_method '{method}' is not supported"):
        detect_format({"quantization_config": OTHER_METHODS[method]})


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
GPTQ_REFUSALS = {
    "bits-8": ({**GPTQ, "bits": 8}, "bits 8"),
    "bits-3": ({**GPTQ, "bits": 3}, "bits 3"),
    "marlin": ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    "dynamic": ({**GPTQ, "dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    "some-modules": ({**GPTQ, "modules_in_block_to_quantize": [["self_attn.q_proj"]]}, "modules_in_block_to_quantize"),
}


@pytest.mark.parametrize("case", list(GPTQ_REFUSALS))
def test_gptq_variants_we_do_not_serve_are_refused(case: str) -> None:
    qc, needle = GPTQ_REFUSALS[case]
    with pytest.raises(ValueError, match="quantization_config: gptq") as info:
        detect_format({"quantization_config": qc})
    assert needle in str(info.value)


def test_served_configs_are_detected() -> None:
    assert detect_format({}) is None
    assert detect_format({"compression_config": library_config("W4A16")}).scheme.label == "int4/compressed-tensors/g128"
    assert detect_format({"quantization_config": library_config("W4A16_ASYM")}).scheme.label == \
        "int4/compressed-tensors/g128"
    w8a16 = detect_format({"quantization_config": library_config("W8A16")})  # int8 per group of 128
    assert (w8a16.scheme.label, w8a16.fields) == ("int8/compressed-tensors/g128",
                                                  {"weight_packed", "weight_scale", "weight_shape"})
    assert detect_format({"quantization_config": library_config("FP8")}).scheme.label == \
        "fp8/compressed-tensors/static"
    assert detect_format({"quantization_config": library_config("FP8_DYNAMIC")}).scheme.label == "fp8/compressed-tensors"
    nvfp4 = detect_format({"quantization_config": library_config("NVFP4")})  # FP4 activations: served weight-only
    assert nvfp4.scheme.label == "fp4/compressed-tensors" and "input_global_scale" in nvfp4.fields
    assert detect_format({"quantization_config": library_config("NVFP4A16")}).scheme.ignore == ("lm_head",)
    assert detect_format({"quantization_config": {**GPTQ, "lm_head": True}}).scheme.ignore == ()
    assert detect_format({"quantization_config": {**GPTQ, "group_size": -1}}).scheme.group_size is None


def test_the_engine_refuses_rather_than_loading_full_precision(tmp_path: Path) -> None:
    build_model(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = library_config("W8A8")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config: compressed-tensors .*W8A8"):
        LLM(model=str(tmp_path), num_blocks=16)

"""Pre-quantized checkpoints built inside the tests by the libraries that define their
formats, and greedy samples of them (transformers' and the engine's) for
tests.quant_models.check_logprobs_close.

compressed-tensors: a random Hugging Face model (tests/hf_models.py) goes through the
library's own life cycle, as llm-compressor drives it, without calibration data:

    apply_quantization_config(model, QuantizationConfig(...))   scales initialised
    compute_dynamic_scales_and_zp / calculate_qparams / generate_gparam on each weight
    (min-max, the library's own arithmetic), static input scales from a forward pass
    ModelCompressor.from_pretrained_model(model, format).compress_model(model)
    model.save_pretrained(dir); compressor.update_config(dir)

and the library decompresses it again through transformers (`hf_decompressed`).

GPTQ: round-to-nearest per group (GPTQ's Hessian updates change which codes are chosen,
not how they are stored), packed by `gptq_pack_spec`, written from AutoGPTQ 0.7.1's
nn_modules/qlinear/qlinear_cuda.py (QuantLinear.pack, and the plain-torch dequantize of
its forward). No GPTQ library is a test dependency: AutoGPTQ's only wheel is built for
CUDA, pulls datasets/peft/pandas, and installs a top-level `tests` package that shadows
ours; GPTQModel needs a CUDA build. When this was written, gptq_pack_spec's bytes were
compared with AutoGPTQ's pack() (its wheel installed with --no-deps, the module loaded
from its file): equal for v1, with and without act order, symmetric and not.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.hf_models import build_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# GPTQ's act order follows the layer input's Hessian: layers reading the same input
# (q/k/v, gate/up) get the same column order
SAME_INPUT = {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0, "self_attn.o_proj": 1,
              "mlp.gate_proj": 2, "mlp.up_proj": 2, "mlp.down_proj": 3}
# hidden 128 / intermediate 256: every layer's inputs divide a group of 128
SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
CALIBRATION = [[5, 17, 42, 99, 7, 3, 250, 64], list(range(10, 70, 2))]

Sample = tuple[list[int], list[dict[int, float]]]  # tokens; per position {token: logprob}


# -- greedy samples, as tests.quant_models.check_logprobs_close compares them -------------


def hf_greedy_logprobs(model: Any, prompts: list[list[int]], max_tokens: int, top: int = 5) -> list[Sample]:
    """Greedy samples of a transformers model, each step's top `top` logprobs (and the
    chosen token's), in the engine's shape."""
    samples = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None)
        tokens = out.sequences[0, len(prompt):].tolist()
        steps = []
        for token, logits in zip(tokens, out.logits):
            lp = torch.log_softmax(logits[0].float(), dim=-1)
            values, idx = lp.topk(top)
            steps.append({**dict(zip(idx.tolist(), values.tolist())), token: lp[token].item()})
        samples.append((tokens, steps))
    return samples


def engine_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, top: int = 5,
                  **llm_kwargs: Any) -> list[Sample]:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), num_blocks=64, **llm_kwargs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=top))
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or [])) for o in outs]


# -- compressed-tensors -------------------------------------------------------------------


def build_ct_checkpoint(path: Path, arch: str, weights: dict[str, Any], input_activations: dict[str, Any] | None = None,
                        fmt: str | None = None, ignore: tuple[str, ...] = ("lm_head",),
                        kv_cache_scheme: dict[str, Any] | None = None, seed: int = 0, **overrides: Any):
    """A random `arch` model quantized and saved by compressed-tensors itself; `fmt`
    forces the library's compressor (None: the one it infers). Returns the
    full-precision model it started from."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import is_module_quantized

    model = build_model(path, arch, seed=seed, **{**SIZES, **overrides})
    act_amax = _input_amax(model) if input_activations and not input_activations.get("dynamic", True) else {}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**input_activations) if input_activations else None)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                kv_cache_scheme=QuantizationArgs(**kv_cache_scheme) if kv_cache_scheme else None)
    apply_quantization_config(model, config, show_progress=False)
    for name, module in model.named_modules():
        if is_module_quantized(module) and isinstance(module, torch.nn.Linear):
            _calibrate(module, act_amax.get(name))
            module.quantization_status = QuantizationStatus.FROZEN
    if kv_cache_scheme:
        _kv_scales(model, config.kv_cache_scheme)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    if kv_cache_scheme and compressor.quantization_config.kv_cache_scheme is None:
        compressor.quantization_config.kv_cache_scheme = config.kv_cache_scheme  # see _kv_scales
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return model


def _kv_scales(model: Any, args: Any) -> None:
    """FP8 KV cache scales, registered by the library's initialize_qparams as
    self_attn.k_scale / v_scale, a value of its own per layer and per K and V.
    compressed-tensors 0.20.1 hooks attention only when its forward takes
    `past_key_value(s)`; transformers 5 renamed that argument `cache`, so
    apply_quantization_config skips the attention modules and this does its part."""
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    cfg = model.config
    shape = (cfg.num_key_value_heads, None, cfg.hidden_size // cfg.num_attention_heads)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for base, value in (("k", 0.01 * (i + 1)), ("v", 0.02 * (i + 1))):
            if not hasattr(attn, f"{base}_scale"):
                initialize_qparams(attn, base, args, observed_shape=shape, observed_dtype=torch.float32,
                                   force_zero_point=False)
            getattr(attn, f"{base}_scale").data.fill_(value)


def _calibrate(module: torch.nn.Linear, input_amax: torch.Tensor | None) -> None:
    """Min-max weight qparams with the library's arithmetic; a static input scale from
    the recorded activations."""
    from compressed_tensors.quantization.utils.helpers import (
        calculate_qparams,
        compute_dynamic_scales_and_zp,
        generate_gparam,
    )

    args = module.quantization_scheme.weights
    w = module.weight.detach()
    global_scale = None
    if hasattr(module, "weight_global_scale"):
        global_scale = generate_gparam(w.min(), w.max())
        module.weight_global_scale.data.copy_(global_scale)
    if args.strategy == "channel":
        scale, zero = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
    else:
        scale, zero = compute_dynamic_scales_and_zp(w, args, module, global_scale=global_scale)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if input_amax is not None:
        a_scale, _ = calculate_qparams(-input_amax.reshape(1), input_amax.reshape(1),
                                       module.quantization_scheme.input_activations)
        module.input_scale.data.copy_(a_scale.reshape(module.input_scale.shape))


def _input_amax(model: Any) -> dict[str, torch.Tensor]:
    """The largest |input| each linear layer sees on the calibration prompts."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(mod, args, name=name):
                a = args[0].detach().abs().amax()
                amax[name] = torch.maximum(amax.get(name, a), a)
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        for prompt in CALIBRATION:
            model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return amax


def hf_decompressed(path: Path) -> Any:
    """The checkpoint loaded by transformers, compressed-tensors decompressing every
    layer to dense weights (the library's own dequantization)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with warnings.catch_warnings():  # "the config's quantization_config is used, dequantize= overrides": meant
        warnings.simplefilter("ignore", UserWarning)
        config = CompressedTensorsConfig(dequantize=True)
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()


# -- GPTQ --------------------------------------------------------------------------------


def gptq_quantize(w: torch.Tensor, group_size: int, act_order: bool, sym: bool, seed: int) -> dict[str, torch.Tensor]:
    """Round-to-nearest GPTQ quantization of w [N, K]: codes [N, K], scales and zeros
    [N, K/G] (fp16-exact scales, integer zeros), g_idx [K]; with act order, the columns
    are visited in a random order (standing in for GPTQ's Hessian order), so g_idx is
    a shuffled group assignment."""
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    groups = k // group_size
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
        if sym:
            s = (torch.maximum(lo.abs(), hi) * 2 / 15).clamp(min=1e-8)
            z = torch.full((n,), 8.0)
        else:
            s = ((hi - lo) / 15).clamp(min=1e-8)
            z = torch.round(-lo / s.half().float()).clamp(0, 15)
        scales[:, g], zeros[:, g] = s.half().float(), z
    s_col, z_col = scales[:, g_idx.long()], zeros[:, g_idx.long()]
    codes = torch.clamp(torch.round(w / s_col) + z_col, 0, 15).to(torch.int32)
    return {"codes": codes, "scales": scales, "zeros": zeros, "g_idx": g_idx,
            "dense": (codes.float() - z_col) * s_col}


def gptq_pack_spec(q: dict[str, torch.Tensor], v2: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ's storage of `gptq_quantize`'s values, as AutoGPTQ's qlinear_cuda.pack writes
    it: qweight [K/8, N] with input k in bits 4*(k%8) of row k//8; qzeros [K/G, N/8]
    with output n in bits 4*(n%8) of column n//8, each zero minus one (v1; as is for
    gptq_v2), masked to 4 bits; scales [K/G, N] fp16; g_idx [K] int32."""
    codes, zeros = q["codes"].t(), q["zeros"].t().to(torch.int64)  # [K, N], [G, N]
    if not v2:
        zeros = zeros - 1
    zeros = zeros & 0xF
    k, n = codes.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(8):
        qweight |= codes[i::8].to(torch.int64) << (4 * i)
    qzeros = torch.zeros(zeros.shape[0], n // 8, dtype=torch.int64)
    for i in range(8):
        qzeros |= zeros[:, i::8] << (4 * i)
    as_int32 = lambda t: (t - ((t >> 31) << 32)).to(torch.int32)  # noqa: E731 (two's complement)
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": q["scales"].t().half().contiguous(),
            "g_idx": q["g_idx"].clone()}


def build_gptq_checkpoint(path: Path, arch: str, group_size: int = 128, desc_act: bool = False, sym: bool = True,
                          v2: bool = False, seed: int = 0, **overrides: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A random model in GPTQ's layout (lm_head full precision; group_size -1: one group
    per row). Returns the
    transformers model holding the dequantized weights (the reference) and those
    weights by checkpoint name."""
    from safetensors.torch import load_file, save_file

    model = build_model(path, arch, seed=seed, **{**SIZES, **overrides})
    state = load_file(str(path / "model.safetensors"))
    dense = {}
    for i in range(model.config.num_hidden_layers):
        for linear in LINEARS:
            name = f"model.layers.{i}.{linear}"
            w = state.pop(f"{name}.weight").float()
            q = gptq_quantize(w, group_size if group_size > 0 else w.shape[1], desc_act, sym,
                              seed * 100 + i * 7 + SAME_INPUT[linear])
            packed = gptq_pack_spec(q, v2)
            state.update({f"{name}.{field}": t.contiguous() for field, t in packed.items()})
            dense[name] = q["dense"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
                                  "sym": sym, "lm_head": False, "true_sequential": True,
                                  "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    (path / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        for name, w in dense.items():
            model.get_submodule(name).weight.copy_(w)
    return model, dense

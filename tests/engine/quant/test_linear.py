"""QuantLinear on a CPU: torch's kernels against dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.quant import apply, formats
from pdserve.engine.quant.config import WeightScheme, online_scheme
from pdserve.engine.quant.linear import INT8PACK_MAX_ROWS, QuantEmbedding, QuantLinear

METHODS = ["int8", "int4", "fp8", "fp4"]
# Relative error of the kernel against x @ dequantized(W)^T: the 16-bit activations of the
# weight-only kernels (bf16: 2^-8), E4M3 activations for fp8 (per token).
TOLERANCE = {"int8": 0.01, "int4": 0.01, "fp8": 0.06, "fp4": 1e-5}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("rows", [1, 5, INT8PACK_MAX_ROWS + 7])
@pytest.mark.parametrize("method", METHODS)
def test_kernel_matches_its_dequantized_weight(method, rows):
    torch.manual_seed(1)
    lin = nn.Linear(256, 96, bias=True)
    layer = QuantLinear.from_float(lin, online_scheme(method))
    w = layer.dequantized()
    layer.prepare()
    x = torch.randn(rows, 256)
    y = layer(x)
    assert y.dtype == x.dtype and y.shape == (rows, 96)
    assert rel(y, x @ w.T + lin.bias) < TOLERANCE[method]
    # and the scheme's own error against the full-precision layer stays in its class
    assert rel(y, lin(x)) < {"int8": 0.02, "int4": 0.1, "fp8": 0.08, "fp4": 0.15}[method]


def test_int4_act_order_permutes_the_activations():
    torch.manual_seed(2)
    w = torch.randn(64, 128)
    perm = torch.randperm(128)
    scheme = WeightScheme("int4", source="gptq", group_size=32, act_order=True)
    layer = QuantLinear(128, 64, False, scheme)
    t = formats.quantize_int4(w[:, perm], 32)
    layer.fill({**t, "perm": perm})
    ref = layer.dequantized()
    layer.prepare()
    x = torch.randn(3, 128)
    assert rel(layer(x), x @ ref.T) < 0.01
    assert rel(ref, w) < 0.1


def test_a_short_row_makes_one_int4_group_and_a_ragged_one_is_refused():
    assert QuantLinear(64, 8, False, online_scheme("int4")).group_size == 64
    with pytest.raises(ValueError, match="int4 needs in_features divisible"):
        QuantLinear(200, 8, False, online_scheme("int4"))
    with pytest.raises(ValueError, match="fp4 needs in_features divisible by 16"):
        QuantLinear(40, 8, False, online_scheme("fp4"))


def test_fill_checks_names_and_shapes():
    layer = QuantLinear(32, 8, False, online_scheme("int8"))
    with pytest.raises(ValueError, match="needs"):
        layer.fill({"weight": torch.zeros(8, 32, dtype=torch.int8)})
    with pytest.raises(ValueError, match="weight has shape"):
        layer.fill({"weight": torch.zeros(8, 16, dtype=torch.int8), "weight_scale": torch.ones(8)})


def test_forward_before_prepare_is_an_error():
    layer = QuantLinear.from_float(nn.Linear(32, 8), online_scheme("int8"))
    with pytest.raises(RuntimeError, match="prepare"):
        layer(torch.randn(1, 32))


def test_static_fp8_input_scale_is_used():
    torch.manual_seed(3)
    lin = nn.Linear(64, 32, bias=False)
    t = formats.quantize_fp8(lin.weight.detach())
    layer = QuantLinear(64, 32, False, WeightScheme("fp8", source="compressed-tensors", static_input_scale=True))
    x = torch.randn(4, 64)
    scale = x.abs().max() / formats.FP8_MAX
    layer.fill({**t, "input_scale": scale})
    layer.prepare()
    xq = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert rel(layer(x), xq @ formats.dequantize("fp8", t).T) < 1e-5


INT8_GROUPS = WeightScheme("int8", source="compressed-tensors", group_size=64)


@pytest.mark.parametrize("rows", [1, 5, INT8PACK_MAX_ROWS + 7])
def test_grouped_int8_kernel_matches_its_dequantized_weight(rows):
    """Both CPU paths (torch's int8 kernel per group; the bf16 dequantized GEMM) against
    x @ W^T with W = q * s[n, k // G], in fp32 and bf16 activations."""
    torch.manual_seed(4)
    lin = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        lin.weight[:, 64:128] *= 30  # a loud group: its scale must stay its own
    layer = QuantLinear.from_float(lin, INT8_GROUPS)
    assert layer.weight_scale.shape == (96, 4) and layer.extra_repr().endswith("int8/compressed-tensors/g64")
    w = layer.dequantized()
    torch.testing.assert_close(w, formats.dequantize_int8(layer.weight, layer.weight_scale, 64))
    layer.prepare()
    x = torch.randn(rows, 256)
    assert rel(layer(x), x @ w.T + lin.bias) < TOLERANCE["int8"]
    assert rel(layer(x), lin(x)) < 0.02
    xb = x.to(torch.bfloat16)
    assert rel(layer(xb).float(), xb.float() @ w.T + lin.bias) < 0.02


def test_grouped_int8_prepared_on_meta_holds_the_bytes_loaded():
    """The memory plan prepares a meta skeleton and sums its buffers: the same as the
    loaded, prepared layer's."""
    with torch.device("meta"):
        skeleton = QuantLinear(256, 96, True, INT8_GROUPS)
    skeleton.prepare()
    real = QuantLinear.from_float(nn.Linear(256, 96), INT8_GROUPS)
    real.prepare()

    def layout(m):
        return sorted((n, tuple(t.shape), t.dtype) for n, t in [*m.named_buffers(), *m.named_parameters()])

    assert layout(skeleton) == layout(real)
    assert apply.weight_bytes(skeleton) == apply.weight_bytes(real) == 96 * 256 + 96 * 4 * 4 + 96 * 2 + 96 * 4


def test_grouped_int8_groups_follow_the_int4_rule():
    assert QuantLinear(32, 8, False, INT8_GROUPS).group_size == 32  # a short row: one group
    assert QuantLinear(32, 8, False, online_scheme("int8")).group_size is None  # online int8: per channel
    with pytest.raises(ValueError, match="int8 per group of 64 needs in_features divisible"):
        QuantLinear(96, 8, False, INT8_GROUPS)


def test_a_grouped_int8_head_is_no_embedding_table():
    head = QuantLinear.from_float(nn.Linear(64, 16), INT8_GROUPS)
    with pytest.raises(ValueError, match="per-row scales"):
        QuantEmbedding(head, torch.float32)

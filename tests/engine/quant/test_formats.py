"""The number formats (engine/quant/formats.py): round trips, layouts, ranges."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.quant import formats

torch.manual_seed(0)


def test_nibbles_put_even_columns_in_the_low_half():
    codes = torch.tensor([[1, 2, 15, 0]])
    packed = formats.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(formats.unpack_nibbles(packed), codes.to(torch.uint8))


def test_int8_is_symmetric_per_output_channel():
    w = torch.randn(8, 32)
    w[3] *= 100  # one loud channel must not cost the others their precision
    t = formats.quantize_int8(w)
    assert t["weight"].dtype == torch.int8 and t["weight_scale"].shape == (8,)
    assert t["weight"].abs().amax(dim=1).tolist() == [127] * 8
    err = (formats.dequantize("int8", t) - w).abs()
    assert (err <= t["weight_scale"][:, None] / 2 + 1e-6).all()


def test_int8_groups_have_their_own_symmetric_scale():
    w = torch.randn(4, 256)
    w[:, 128:] *= 50  # a loud group must not cost the quiet one its precision
    t = formats.quantize_int8(w, 128)
    assert t["weight"].shape == (4, 256) and t["weight_scale"].shape == (4, 2)
    assert t["weight"].view(4, 2, 128).abs().amax(dim=-1).tolist() == [[127, 127]] * 4
    err = (formats.dequantize("int8", t, 128) - w).abs()
    assert (err <= t["weight_scale"].repeat_interleave(128, dim=1) / 2 + 1e-5).all()
    assert err[:, :128].max() < 0.02
    # one group the row's width is per channel
    per_row = formats.quantize_int8(w, 256)
    assert torch.equal(per_row["weight"], formats.quantize_int8(w)["weight"])


def test_int4_groups_have_their_own_scale_and_integer_zero():
    w = torch.randn(4, 256)
    w[:, :128] += 3.0  # a shifted group: the zero point moves, the other group's does not
    t = formats.quantize_int4(w, 128)
    assert t["weight_packed"].shape == (4, 128) and t["weight_scale"].shape == (4, 2)
    assert torch.equal(t["weight_zero"], t["weight_zero"].round())
    assert (t["weight_zero"][:, 0] < t["weight_zero"][:, 1]).all()
    err = (formats.dequantize("int4", t, 128) - w).abs()
    scale = t["weight_scale"].repeat_interleave(128, dim=1)
    assert (err <= scale / 2 + 1e-5).all()


def test_int4_act_order_permutation_puts_columns_back():
    w = torch.randn(4, 64)
    perm = torch.randperm(64)
    t = formats.quantize_int4(w[:, perm], 32)  # stored column j is input column perm[j]
    t["perm"] = perm
    assert torch.allclose(formats.dequantize("int4", t, 32), w, atol=0.3)


def test_fp8_clamps_to_the_format_range_before_casting():
    w = torch.randn(4, 16)
    t = formats.quantize_fp8(w)
    assert t["weight"].dtype == torch.float8_e4m3fn
    assert t["weight"].float().abs().amax(dim=1).tolist() == [formats.FP8_MAX] * 4
    assert torch.isfinite(t["weight"].float()).all()
    rel = ((formats.dequantize("fp8", t) - w).abs() / w.abs().clamp(min=1e-3)).median()
    assert rel < 0.04
    x = torch.tensor([[1e6, -1e6, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    xq, s = formats.quantize_fp8_activations(x, None)
    assert torch.isfinite(xq.float()).all() and torch.isfinite(s).all()
    xq, s = formats.quantize_fp8_activations(x, torch.tensor(1.0))  # static: the big values saturate, not inf
    assert xq.float().abs().max() == formats.FP8_MAX


def test_fp4_values_lie_on_the_e2m1_grid_with_fp8_block_scales():
    w = torch.randn(3, 64)
    t = formats.quantize_fp4(w)
    assert t["weight_packed"].shape == (3, 32) and t["weight_scale"].shape == (3, 4)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_global_scale"].shape == (3,)
    codes = formats.unpack_nibbles(t["weight_packed"]).long()
    grid = torch.tensor(formats.E2M1_VALUES)
    assert set(grid.tolist()) >= set(torch.cat((grid, -grid))[codes].abs().unique().tolist())
    # each block's largest magnitude lands on (or next to) the grid's top
    deq = formats.dequantize("fp4", t)
    assert ((deq - w).norm() / w.norm()) < 0.15
    # one global scale for the tensor: the largest block scale sits at E4M3's top
    assert t["weight_scale"].float().max() == pytest.approx(formats.FP8_MAX, rel=0.07)


@pytest.mark.parametrize("method,group", [("int8", None), ("int8", 32), ("int4", 128), ("fp8", None), ("fp4", None)])
def test_a_zero_weight_quantizes_to_zero_without_nan(method, group):
    t = formats.quantize(method, torch.zeros(4, 128), group)
    deq = formats.dequantize(method, t, group)
    assert torch.equal(deq, torch.zeros(4, 128))

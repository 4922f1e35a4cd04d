"""int8 weights through FBGEMM's int8 x int8 GEMM (engine/quant/cpu_int8.py): each row
quantized alone, so a row's output is the same whatever it is batched with; close to
the dequantized weight's GEMM; a layer on it holds the packed weight instead of its
matrix (counted as that matrix); the choice between it and torch's W8A16 kernels is
measured at load and logged; and the engine's tokens do not depend on the batch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.quant import apply, cpu_int8
from pdserve.engine.quant.config import online_scheme
from pdserve.engine.quant.linear import QuantLinear
from hf_models import build_model

pytestmark = pytest.mark.skipif(not cpu_int8.available(), reason="this torch has no FBGEMM")


def layer(n: int = 96, k: int = 160, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    q = QuantLinear.from_float(nn.Linear(k, n, bias=True), online_scheme("int8"))
    q.prepare()
    return q


def test_a_rows_output_does_not_depend_on_its_batch():
    q = layer()
    packed, pin = cpu_int8.pack(q.weight, q.weight_scale), cpu_int8.pin_row(q.in_features)
    torch.manual_seed(1)
    rows = torch.randn(37, q.in_features)
    rows[5] *= 100.0  # an outlier row changes nothing for the others
    batched = cpu_int8.linear(rows, packed, pin)
    for i in (0, 5, 36):
        assert torch.equal(cpu_int8.linear(rows[i:i + 1], packed, pin)[0], batched[i])
    assert torch.equal(cpu_int8.linear(rows[:3], packed, pin), batched[:3])


def test_close_to_the_dequantized_weights_gemm():
    q = layer(n=256, k=512)
    reference_weight = q.dequantized()
    packed, pin = cpu_int8.pack(q.weight, q.weight_scale), cpu_int8.pin_row(q.in_features)
    x = torch.randn(16, q.in_features)
    want = x @ reference_weight.t()
    got = cpu_int8.linear(x, packed, pin)
    assert ((got - want).norm() / want.norm()).item() < 0.03  # 7-bit activations per token


def test_a_layer_on_w8a8_holds_the_packed_weight_instead_of_its_matrix():
    q = layer()
    before, weight = q.dequantized(), q.weight.clone()
    x = torch.randn(4, q.in_features)
    q.use_w8a8()
    assert not hasattr(q, "weight") and q.packed_nbytes == weight.numel()
    assert torch.equal(q.dequantized(), before)  # unpacked from FBGEMM's copy
    expected = cpu_int8.linear(x, cpu_int8.pack(weight, q.weight_scale), cpu_int8.pin_row(q.in_features)) + q.bias
    assert torch.equal(q(x), expected)


def test_the_choice_is_measured_logged_and_spares_a_tied_head(tmp_path, caplog):
    build_model(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.model.loader"):
        llm = LLM(model=str(tmp_path), quantization="int8", num_blocks=32)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("int8 kernel: "))
    assert "1 rows" in line and "8 rows" in line and "64 rows" in line
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    on_w8a8 = [m for m in layers if m.packed_nbytes]
    assert bool(on_w8a8) == line.startswith("int8 kernel: W8A8")
    assert model.lm_head._packed is None and hasattr(model.lm_head, "weight")  # the embedding reads its rows
    assert llm.engine.memory.weight_bytes == apply.weight_bytes(model)


def test_the_engines_tokens_do_not_depend_on_the_batch(tmp_path, monkeypatch):
    """W8A8 forced (whatever this CPU measures): a prompt alone and among others."""
    monkeypatch.setattr(cpu_int8, "choose", lambda *a: cpu_int8.Choice(True, (0, 0), {}))
    build_model(tmp_path, "llama", hidden_size=128, intermediate_size=256, tie_word_embeddings=False)
    llm = LLM(model=str(tmp_path), quantization="int8", num_blocks=64)
    assert any(m.packed_nbytes for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 21, 34], [7, 7, 8, 100, 3, 4, 5, 6, 7], [11] * 20, [40, 41, 42]]
    together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    alone = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
    assert together == alone

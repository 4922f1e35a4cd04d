"""--dtype auto (engine/config.py resolve_dtype): a float32 checkpoint stays float32; a
half-precision one runs in bfloat16 where the hardware computes in it natively, in
float32 on a CPU without AMX or AVX512-BF16. The CPU's and GPU's capabilities are read
from torch; the table below sets them to cover every row on any machine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.config import ModelConfig, resolve_dtype
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.worker.config import WorkerConfig


def cpu_with(monkeypatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


@pytest.mark.parametrize("amx, avx512_bf16, checkpoint, expected", [
    (True, True, "float32", torch.float32),
    (False, False, "float32", torch.float32),
    (True, False, "bfloat16", torch.bfloat16),
    (False, True, "bfloat16", torch.bfloat16),
    (False, True, "float16", torch.bfloat16),
    (False, True, None, torch.bfloat16),
    (False, False, "bfloat16", torch.float32),
    (False, False, None, torch.float32),
])
def test_auto_on_a_cpu(monkeypatch, amx, avx512_bf16, checkpoint, expected):
    cpu_with(monkeypatch, amx, avx512_bf16)
    dtype, why = resolve_dtype("auto", "cpu", checkpoint)
    assert dtype == expected and why.startswith("auto: ")
    if checkpoint != "float32":
        assert ("AMX" if amx else "AVX512-BF16") in why


@pytest.mark.parametrize("bf16, checkpoint, expected", [
    (True, "float32", torch.float32), (True, "bfloat16", torch.bfloat16), (True, "float16", torch.float16),
    (True, None, torch.bfloat16), (False, "bfloat16", torch.float16),
])
def test_auto_on_a_gpu(monkeypatch, bf16, checkpoint, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", "cuda", checkpoint)[0] == expected


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_a_named_dtype_is_taken_as_asked(monkeypatch, name):
    cpu_with(monkeypatch, True, True)
    assert resolve_dtype(name, "cpu", "bfloat16") == (getattr(torch, name), "as asked (--dtype)")


def test_unknown_dtypes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="^dtype"):
        resolve_dtype("float64", "cpu")
    with pytest.raises(ValueError, match="^dtype"):
        WorkerConfig(dtype="fp8")


@pytest.mark.parametrize("entry, expected", [({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                                             ({"torch_dtype": "float32"}, "float32"), ({}, None),
                                             ({"dtype": "float8_e4m3fn"}, None)])
def test_the_checkpoint_dtype_is_read_from_config_json(tmp_path, entry, expected):
    cfg = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **entry}))
    assert ModelConfig.from_dir(tmp_path).checkpoint_dtype == expected


def test_the_engine_says_what_it_chose_and_why(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.engine.engine"):
        LLM(model=DEFAULT_MODEL, num_blocks=16)
    assert "dtype: float32 (auto: the checkpoint is float32)" in caplog.text

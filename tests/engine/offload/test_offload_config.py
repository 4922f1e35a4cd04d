"""The kv_offload_* settings: refused at start with a message naming the flag, on the
engine's config and the worker's flags alike."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.offload import config as offload_config


def make(**kw) -> EngineConfig:
    return EngineConfig(model=DEFAULT_MODEL, **kw)


def test_off_by_default() -> None:
    assert not make().kv_offload


@pytest.mark.parametrize("kw, flag", [
    (dict(kv_offload_host_bytes=-1), "kv_offload_host_bytes"),
    (dict(kv_offload_disk_bytes=-5, kv_offload_dir="/tmp/x"), "kv_offload_disk_bytes"),
    (dict(kv_offload_disk_bytes=100), "kv_offload_disk_bytes"),  # no directory
    (dict(kv_offload_persist=True), "kv_offload_persist"),  # no directory
    (dict(kv_offload_policy="mru"), "kv_offload_policy"),
    (dict(kv_offload_disk_policy="fifo"), "kv_offload_disk_policy"),
    (dict(kv_offload_queue_depth=0), "kv_offload_queue_depth"),
    (dict(kv_offload_deadline=0.0), "kv_offload_deadline"),
    (dict(kv_offload_onload_timeout=-1.0), "kv_offload_onload_timeout"),
])
def test_nonsense_is_refused_naming_the_flag(kw, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        make(**kw)


def test_a_directory_without_a_budget_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_offload_disk_bytes"):
        make(kv_offload_dir=str(tmp_path))


def test_a_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="kv_offload_dir.*not a directory"):
        make(kv_offload_dir=str(f), kv_offload_disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_offload_dir"):  # under a file
        make(kv_offload_dir=str(f / "sub"), kv_offload_disk_bytes=1 << 20)


def test_an_unwritable_directory_is_refused(tmp_path: Path, monkeypatch) -> None:
    real = os.access
    monkeypatch.setattr(offload_config.os, "access", lambda p, mode: False if Path(p) == tmp_path else real(p, mode))
    with pytest.raises(ValueError, match="kv_offload_dir.*not writable"):
        make(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)


def test_more_host_bytes_than_the_machine_has_is_refused() -> None:
    memory = offload_config.physical_memory()
    if memory is None:
        pytest.skip("the OS does not say how much memory it has")
    with pytest.raises(ValueError, match="kv_offload_host_bytes.*more than this machine's memory"):
        make(kv_offload_host_bytes=memory + 1)


def test_a_sound_setting_passes(tmp_path: Path) -> None:
    cfg = make(kv_offload_host_bytes=1 << 20, kv_offload_dir=str(tmp_path / "new"), kv_offload_disk_bytes=1 << 20,
               kv_offload_persist=True, kv_offload_policy="arc")
    assert cfg.kv_offload


def test_a_draft_model_with_tiers_is_refused_at_start() -> None:
    from pdserve.engine.config import DEFAULT_DRAFT_MODEL
    from pdserve.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="kv_offload_host_bytes, kv_offload_dir: .*draft model"):
        LLMEngine(make(kv_offload_host_bytes=1 << 20, speculative={
            "method": "draft_model", "model": DEFAULT_DRAFT_MODEL, "num_speculative_tokens": 2}))

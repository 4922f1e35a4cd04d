"""A worker's settings (services/worker/config.py): --speculative-config from the flag
or PDSERVE_SPECULATIVE_CONFIG, parsed into the engine's config; a bad value stops the
worker at start, naming speculative_config.<key>. --quantization, --kv-cache-dtype and
--gpu-memory-utilization likewise, for every role alike."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest

from cluster_helpers import REPO, child_env
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.services.common.flags import parse_argv, to_argv
from pdserve.services.worker.config import ROLES, WorkerConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("role", ROLES)
def test_the_speculative_config_flag_reaches_the_engines_of_decoding_roles(role):
    config = parse_argv(WorkerConfig, ["--speculative-config", json.dumps(NGRAM)], role=role)
    assert config.speculative == SpeculativeConfig.parse(NGRAM)
    # only decoding speculates: a prefill worker's engine runs without (no draft model loaded)
    want = None if role == "prefill" else SpeculativeConfig(**NGRAM)
    assert config.engine_config().speculative == want
    assert parse_argv(WorkerConfig, to_argv(config), role=role) == config  # what launchers hand their workers


def test_the_speculative_config_comes_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("PDSERVE_SPECULATIVE_CONFIG", json.dumps(NGRAM))
    assert parse_argv(WorkerConfig, [], role="decode").engine_config().speculative == SpeculativeConfig(**NGRAM)
    flag = json.dumps({**NGRAM, "num_speculative_tokens": 2})
    assert parse_argv(WorkerConfig, ["--speculative-config", flag], role="decode").speculative.num_speculative_tokens == 2


def test_without_the_flag_nothing_speculates():
    assert WorkerConfig(role="decode").speculative is None
    assert WorkerConfig(role="decode").engine_config().speculative is None


@pytest.mark.parametrize("value, key", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "/nowhere"}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "/nowhere"}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "k": 1}, "speculative_config.k"),
    ("[1, 2]", "speculative_config"),
    ("{not json", "speculative_config"),
])
def test_a_bad_speculative_config_is_refused_naming_its_key(value, key):
    text = value if isinstance(value, str) else json.dumps(value)
    for role in ROLES:  # every role checks it, prefill too: a typo is never silently ignored
        with pytest.raises(ValueError, match=rf"^{key}: "):
            WorkerConfig(role=role, speculative_config=text)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_worker_with_a_bad_speculative_config_stops_at_start_naming_the_key(how):
    """`pdserve decode` exits 2 before loading anything, with the engine's message."""
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    argv = ["--speculative-config", bad] if how == "flag" else []
    env = child_env() | ({"PDSERVE_SPECULATIVE_CONFIG": bad} if how == "env" else {})
    run = subprocess.run([sys.executable, "-m", "pdserve", "decode", "--port", "0", *argv], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "pdserve: speculative_config.prompt_lookup_min: must be <= prompt_lookup_max (2), got 4" in run.stderr


STORAGE = {"quantization": "int8", "kv_cache_dtype": "fp8_e4m3", "gpu_memory_utilization": 0.75}


@pytest.mark.parametrize("role", ROLES)
def test_storage_flags_reach_the_engine_of_every_role(role):
    """Unlike --speculative-config, prefill workers take them too: the KV a prefill
    worker ships is read as stored by its decode worker."""
    argv = ["--quantization", "int8", "--kv-cache-dtype", "fp8_e4m3", "--gpu-memory-utilization", "0.75"]
    config = parse_argv(WorkerConfig, argv, role=role)
    engine = config.engine_config()
    assert {name: getattr(engine, name) for name in STORAGE} == STORAGE
    assert parse_argv(WorkerConfig, to_argv(config), role=role) == config  # what launchers hand their workers


def test_storage_flags_default_to_the_checkpoints_own_format():
    engine = WorkerConfig(role="decode").engine_config()
    assert (engine.quantization, engine.kv_cache_dtype, engine.gpu_memory_utilization) == (None, "auto", 0.9)


@pytest.mark.parametrize("field", STORAGE)
def test_storage_flags_come_from_the_environment_too(monkeypatch, field):
    monkeypatch.setenv(f"PDSERVE_{field.upper()}", str(STORAGE[field]))
    assert getattr(parse_argv(WorkerConfig, [], role="prefill"), field) == STORAGE[field]


@pytest.mark.parametrize("field, value", [("quantization", "int3"), ("quantization", "gptq"),
                                          ("kv_cache_dtype", "fp16"), ("gpu_memory_utilization", 0.0),
                                          ("gpu_memory_utilization", 1.01)])
def test_a_bad_storage_flag_is_refused_naming_its_field(field, value):
    for role in ROLES:
        with pytest.raises(ValueError, match=rf"^{field}: "):
            WorkerConfig(role=role, **{field: value})


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_worker_with_a_bad_kv_cache_dtype_stops_at_start_naming_the_field(how):
    argv = ["--kv-cache-dtype", "fp16"] if how == "flag" else []
    env = child_env() | ({"PDSERVE_KV_CACHE_DTYPE": "fp16"} if how == "env" else {})
    run = subprocess.run([sys.executable, "-m", "pdserve", "prefill", "--port", "0", *argv], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "pdserve: kv_cache_dtype: unknown 'fp16'" in run.stderr


def test_kv_offload_flags_and_environment(monkeypatch, tmp_path: Path) -> None:
    argv = ["--kv-offload-host-bytes", "1048576", "--kv-offload-dir", str(tmp_path), "--kv-offload-disk-bytes",
            "4194304", "--kv-offload-persist", "--kv-offload-policy", "arc", "--kv-offload-disk-policy", "lru"]
    engine = parse_argv(WorkerConfig, argv).engine_config()
    assert (engine.kv_offload_host_bytes, engine.kv_offload_dir, engine.kv_offload_disk_bytes,
            engine.kv_offload_persist, engine.kv_offload_policy, engine.kv_offload_disk_policy) == (
        1 << 20, str(tmp_path), 4 << 20, True, "arc", "lru")
    monkeypatch.setenv("PDSERVE_KV_OFFLOAD_HOST_BYTES", "2048")
    assert parse_argv(WorkerConfig, []).engine_config().kv_offload_host_bytes == 2048
    with pytest.raises((ValueError, SystemExit)):
        parse_argv(WorkerConfig, ["--kv-offload-host-bytes", "-1"])
    with pytest.raises((ValueError, SystemExit)):
        parse_argv(WorkerConfig, ["--kv-offload-policy", "mru"])


STRUCTURED = {"structured_outputs_backend": "llguidance", "structured_outputs_compile_timeout": 2.5,
              "structured_outputs_max_bytes": 4096, "structured_outputs_max_depth": 8}


@pytest.mark.parametrize("role", ROLES)
def test_structured_outputs_flags_reach_the_engine_of_every_role(role, monkeypatch):
    """A prefill worker samples the first token under the same constraint: every role."""
    argv = ["--structured-outputs-backend", "llguidance", "--structured-outputs-compile-timeout", "2.5",
            "--structured-outputs-max-bytes", "4096"]
    monkeypatch.setenv("PDSERVE_STRUCTURED_OUTPUTS_MAX_DEPTH", "8")
    config = parse_argv(WorkerConfig, argv, role=role)
    engine = config.engine_config()
    assert {name: getattr(engine, name) for name in STRUCTURED} == STRUCTURED
    assert parse_argv(WorkerConfig, to_argv(config), role=role) == config


@pytest.mark.parametrize("field, value", [("structured_outputs_backend", "outlines"),
                                          ("structured_outputs_compile_timeout", 0.0),
                                          ("structured_outputs_max_bytes", 0), ("structured_outputs_max_depth", 5000)])
def test_a_bad_structured_outputs_flag_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        WorkerConfig(role="mixed", **{field: value})

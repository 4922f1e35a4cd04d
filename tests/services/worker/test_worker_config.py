"""A worker's settings (services/worker/config.py): --speculative-config from the flag
or PDSERVE_SPECULATIVE_CONFIG, parsed into the engine's config; a bad value stops the
worker at start, naming speculative_config.<key>."""

from __future__ import annotations

import json
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
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
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

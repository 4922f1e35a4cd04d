"""SpeculativeConfig.parse: vLLM's shape, vLLM's defaults, every refusal naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine.spec.config import SpeculativeConfig


@pytest.fixture
def draft_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_ngram_defaults_are_vllms():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 5, 5)
    assert c.model is None and c.disable_by_batch_size is None


@pytest.mark.parametrize(("given", "bounds"), [
    ({"prompt_lookup_max": 7}, (7, 7)),
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 1}, (1, 1)),
])
def test_one_bound_gives_the_other(given, bounds):
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == bounds


def test_json_string_and_config_parse_the_same():
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 3, "disable_by_batch_size": 8})
    c = SpeculativeConfig.parse(text)
    assert c == SpeculativeConfig("ngram", 4, 2, 3, None, 8)
    assert SpeculativeConfig.parse(c) is c


def test_draft_model(draft_dir):
    c = SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 5, "model": draft_dir})
    assert (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("draft_model", draft_dir, None, None)


def test_frozen():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 1})
    with pytest.raises(AttributeError):
        c.num_speculative_tokens = 2  # type: ignore[misc]


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize(("value", "message"), [
    ({**NGRAM, "method": "medusa"}, "speculative_config.method: must be one of ngram, draft_model, eagle, eagle3, "
                                    "got 'medusa'"),
    ({**NGRAM, "method": "eagle"}, "speculative_config.model: is required for method eagle"),
    ({**NGRAM, "method": "eagle3", "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max: is not a key of "
                                                            "method eagle3"),
    ({**NGRAM, "method": 1}, "speculative_config.method: must be one of"),
    ({"num_speculative_tokens": 2}, "speculative_config.method: is required"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens: is required"),
    ({**NGRAM, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens: must be an integer >= 1, got 0"),
    ({**NGRAM, "num_speculative_tokens": 2.0}, "speculative_config.num_speculative_tokens: must be an integer >= 1"),
    ({**NGRAM, "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens: must be an integer >= 1"),
    ({**NGRAM, "num_speculative_tokens": "2"}, "speculative_config.num_speculative_tokens: must be an integer >= 1"),
    ({**NGRAM, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min: must be an integer >= 1, got 0"),
    ({**NGRAM, "prompt_lookup_max": -1}, "speculative_config.prompt_lookup_max: must be an integer >= 1, got -1"),
    ({**NGRAM, "prompt_lookup_max": "5"}, "speculative_config.prompt_lookup_max: must be an integer >= 1"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min: must be <= prompt_lookup_max (3), got 4"),
    ({**NGRAM, "model": "/x"}, "speculative_config.model: is not a key of method ngram, got '/x'"),
    ({**NGRAM, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size: must be an integer >= 1, got 0"),
    ({**NGRAM, "disable_by_batch_size": 1.5}, "speculative_config.disable_by_batch_size: must be an integer >= 1"),
    ({**NGRAM, "draft_tensor_parallel_size": 1}, "speculative_config.draft_tensor_parallel_size: unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model: is required for method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, "speculative_config.model: must be a directory path"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "speculative_config.model: must be a directory path"),
    ("[1, 2]", "speculative_config: must be a JSON object or a dict, got [1, 2]"),
    ("{not json", "speculative_config: not valid JSON"),
    (7, "speculative_config: must be a JSON object or a dict, got 7"),
])
def test_refusals_name_the_key(value, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(value)
    assert str(e.value).startswith(message)


def test_draft_model_directory_must_hold_config_json(tmp_path: Path):
    with pytest.raises(ValueError, match=r"^speculative_config\.model: must be a directory holding a Hugging Face config\.json"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path)})
    with pytest.raises(ValueError, match=r"^speculative_config\.model: must be a directory holding"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path / "none")})


@pytest.mark.parametrize("key", ["prompt_lookup_min", "prompt_lookup_max"])
def test_draft_model_refuses_lookup_keys(draft_dir, key):
    with pytest.raises(ValueError, match=rf"^speculative_config\.{key}: is not a key of method draft_model, got 3"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2, "model": draft_dir, key: 3})


def test_a_huge_value_is_cut_short_in_the_message():
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse({**NGRAM, "method": "x" * 10_000})
    assert len(str(e.value)) < 400


def test_measure_payoff_is_a_boolean_and_on_by_default():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).measure_payoff is True
    off = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "measure_payoff": False})
    assert off.measure_payoff is False
    with pytest.raises(ValueError, match="speculative_config.measure_payoff: must be true or false"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "measure_payoff": "no"})

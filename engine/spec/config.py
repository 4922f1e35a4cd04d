"""`speculative_config`, in vLLM's shape: parsed from a dict or a JSON string, checked whole.

    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_min": 2, "prompt_lookup_max": 5}            -> SpeculativeConfig
    {"method": "draft_model", "num_speculative_tokens": 4,
     "model": "/path/to/small-model"}                           -> SpeculativeConfig
    {"method": "eagle3", "num_speculative_tokens": 4,
     "model": "/path/to/eagle3-head"}                           -> SpeculativeConfig

Every refused value raises `ValueError` naming its key as `speculative_config.<key>`, as
`SamplingParams` names its fields. Keys that do not belong to the method are refused,
never ignored: a draft_model config with `prompt_lookup_max` is a mistake, not a default.
What needs the target model (the draft's vocabulary and tokenizer matching it) is checked
when the engine starts, not here.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

from pdserve.engine.sampling_params import check_field, short_repr

Method = Literal["ngram", "draft_model", "eagle", "eagle3"]
METHODS = ("ngram", "draft_model", "eagle", "eagle3")
EAGLE_METHODS = ("eagle", "eagle3")  # a head over the target's hidden states: it runs on prefill workers too
PREFIX = "speculative_config"
# vLLM's defaults: with neither bound given both are 5; with one, the other equals it.
DEFAULT_PROMPT_LOOKUP = 5
NGRAM_KEYS = frozenset({"prompt_lookup_min", "prompt_lookup_max"})
DRAFT_MODEL_KEYS = frozenset({"model"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative config. For ngram both lookup bounds are set (1 <= min <= max)
    and `model` is None; for draft_model, eagle and eagle3 `model` is a directory holding
    config.json (a draft model, or an EAGLE head: engine/spec/eagle_head.py) and the
    lookup bounds are None. `disable_by_batch_size`: None, or the running batch size
    from which speculation turns off. `measure_payoff` (pdserve's own key, on by
    default): draft only while the engine's timings say drafting pays (adaptive.Payoff);
    off, every eligible step drafts (what a test of the counters wants)."""

    method: Method
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    measure_payoff: bool = True

    def __post_init__(self) -> None:
        check_field(self.method in METHODS, f"{PREFIX}.method", f"must be one of {', '.join(METHODS)}", self.method)
        _check_int(self.num_speculative_tokens, "num_speculative_tokens")
        if self.disable_by_batch_size is not None:
            _check_int(self.disable_by_batch_size, "disable_by_batch_size")
        check_field(isinstance(self.measure_payoff, bool), f"{PREFIX}.measure_payoff", "must be true or false",
                    self.measure_payoff)
        if self.method == "ngram":
            self._resolve_lookup()
            _refuse_foreign(self, DRAFT_MODEL_KEYS)
        else:  # draft_model, eagle, eagle3: a model directory
            _refuse_foreign(self, NGRAM_KEYS)
            _check_model_dir(self.model, self.method)

    def _resolve_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value is not None:
                _check_int(value, key)
        low, high = (low or high or DEFAULT_PROMPT_LOOKUP), (high or low or DEFAULT_PROMPT_LOOKUP)
        check_field(low <= high, f"{PREFIX}.prompt_lookup_min", f"must be <= prompt_lookup_max ({high})", low)
        # The bounds are derived values of a frozen config: set once, here, never after.
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, object] | str) -> SpeculativeConfig:
        """A config from a dict, a JSON object string (`--speculative-config JSON`) or a
        config (returned as is)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = _load_json(value)
        check_field(isinstance(value, Mapping), PREFIX, "must be a JSON object or a dict", value)
        known = {f.name for f in fields(cls)}
        for key in value:
            check_field(isinstance(key, str) and key in known, f"{PREFIX}.{key}",
                        f"unknown key (known: {', '.join(sorted(known))})", key)
        for key in ("method", "num_speculative_tokens"):
            check_field(key in value, f"{PREFIX}.{key}", "is required", None)
        return cls(**value)


def _load_json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{PREFIX}: not valid JSON ({e.msg} at character {e.pos}), got {short_repr(text)}") from None


def _check_int(value: object, key: str) -> None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
    check_field(ok, f"{PREFIX}.{key}", "must be an integer >= 1", value)


def _refuse_foreign(config: SpeculativeConfig, keys: frozenset[str]) -> None:
    for key in sorted(keys):
        value = getattr(config, key)
        check_field(value is None, f"{PREFIX}.{key}", f"is not a key of method {config.method}", value)


def _check_model_dir(model: object, method: str) -> None:
    check_field(model is not None, f"{PREFIX}.model", f"is required for method {method}", model)
    check_field(isinstance(model, str) and model != "", f"{PREFIX}.model", "must be a directory path", model)
    check_field(os.path.isfile(os.path.join(str(model), "config.json")), f"{PREFIX}.model",
                "must be a directory holding a Hugging Face config.json", model)

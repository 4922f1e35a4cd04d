"""Per-request generation parameters, validated on construction.

Every out-of-range value raises `ValueError` naming the field, so the router can turn
it into INVALID_ARGUMENT as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

EarlyStopping = bool | Literal["never"]
MAX_CACHE_SALT = 512


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs of each generated token (+ the chosen one)
    prompt_logprobs: int | None = None
    n: int = 1
    beam_width: int = 1  # > 1: beam search
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    # Tenant isolation of the prefix cache (engine/hashing.py): requests with different
    # salts never share cached blocks. Not a sampling setting, but per request.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]", self.min_tokens)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(self.top_k >= 0, "top_k", "must be >= 0 (or -1 for off)", self.top_k)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.beam_width >= 1, "beam_width", "must be >= 1", self.beam_width)
        if self.beam_width > 1:
            _check(self.n <= self.beam_width, "n", "must be <= beam_width for beam search", self.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, "must be >= 0", value)
        _check(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0", self.stop_token_ids)
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and len(self.cache_salt) <= MAX_CACHE_SALT),
               "cache_salt", f"must be a string of at most {MAX_CACHE_SALT} characters", self.cache_salt)
        _check(self.early_stopping in (True, False, "never"), "early_stopping", "must be true, false or 'never'", self.early_stopping)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")

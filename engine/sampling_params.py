"""Per-request generation parameters, validated on construction.

Every out-of-range value raises `ValueError` naming the field, so the router can turn
it into INVALID_ARGUMENT as is. What depends on the model or the server (vocabulary,
logprob caps, n limits) is checked by `engine/validation.py`.

Beam search (beam_width > 1) is deterministic, step for step Hugging Face's
`generate(num_beams=k, do_sample=False)`: it honours `stop_token_ids` (as EOS, like HF's
list of `eos_token_id`), `repetition_penalty` (on the log-probabilities, as HF's logits
processor), `min_tokens`, `ignore_eos` and `prompt_logprobs`; temperature and seed
do not enter it. Fields it would otherwise ignore are refused, never dropped: `stop`
strings, presence / frequency penalties, `logprobs`, `top_k`, `top_p` and `min_p`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

from pdserve.engine.structured.params import StructuredOutputs

EarlyStopping = bool | Literal["never"]
MAX_CACHE_SALT = 512
MAX_VALUE_REPR = 120  # characters of a refused value an error message quotes
SEED_RANGE = (-(1 << 63), 1 << 64)  # int64 or uint64: what a seed can mean anywhere
# Temperatures below this sample as greedy (as vLLM): dividing by them overflows.
GREEDY_TEMPERATURE = 1e-5
# Logits divided by a smaller penalty overflow float32 (and the request samples from
# NaNs); a larger one only zeroes them. vLLM takes any value > 0.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# |length_penalty| above this overflows gen_len ** length_penalty in a float.
MAX_LENGTH_PENALTY = 16.0
FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "length_penalty",
)
INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "n", "beam_width", "sample_index", "resumed_tokens")
# Fields beam search cannot honour, with the value that leaves them off.
BEAM_REFUSED = (
    ("stop", ()), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logprobs", None),
    ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("structured_outputs", None), ("logit_bias", ()),
)
# OpenAI's range for a logit bias, and how many tokens one request may bias.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 1024


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
    # Which sample of a request with n > 1 this one-sequence request is (0: the first,
    # or n == 1): its seeded draws are keyed as that sample's (engine/sampler.py). The
    # router's continuation of sample i after a stream migration sets it to i.
    sample_index: int = 0
    # The prompt's last `resumed_tokens` tokens are this sequence's own output from
    # before (a stream migration's continuation): presence and frequency penalties,
    # which count output only, count them too.
    resumed_tokens: int = 0
    # What the output must match (JSON schema, regex, choice, grammar): each step's
    # token mask comes from the request's grammar matcher (engine/structured/).
    structured_outputs: StructuredOutputs | None = None
    # (token id, bias) pairs, sorted by id, added to the logits before sampling (OpenAI's
    # logit_bias; a dict is taken too). Reported logprobs are the model's, unbiased.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self._check_constraints()
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):  # None: none; any other non-list is refused
            value = () if getattr(self, name) is None else getattr(self, name)
            check_field(isinstance(value, (list, tuple)), name, "must be a list", value)
            object.__setattr__(self, name, tuple(value))
        check_field(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids", "must be integers", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            check_field(_is_number(value) and math.isfinite(value), name, "must be a finite number", value)
        for name in INT_FIELDS:
            check_field(_is_int(getattr(self, name)), name, "must be an integer", getattr(self, name))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check_field(value is None or _is_int(value), name, "must be an integer or unset", value)
        check_field(self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed", "must fit in 64 bits",
                    self.seed)
        check_field(all(isinstance(s, str) for s in self.stop), "stop", "must be strings", self.stop)
        check_field(self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        check_field(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]", self.min_tokens)
        check_field(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        check_field(self.top_k >= 0, "top_k", "must be >= 0 (or -1 for off)", self.top_k)
        check_field(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        check_field(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        check_field(REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
                    "repetition_penalty", f"must be in [{REPETITION_PENALTY_RANGE[0]:g}, {REPETITION_PENALTY_RANGE[1]:g}]",
                    self.repetition_penalty)
        check_field(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        check_field(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        check_field(self.n >= 1, "n", "must be >= 1", self.n)
        check_field(self.beam_width >= 1, "beam_width", "must be >= 1", self.beam_width)
        check_field(0 <= self.resumed_tokens < 1 << 31, "resumed_tokens", "must be in [0, 2**31)", self.resumed_tokens)
        check_field(0 <= self.sample_index < 1 << 31, "sample_index", "must be in [0, 2**31)", self.sample_index)
        check_field(self.sample_index == 0 or (self.n == 1 and self.beam_width == 1), "sample_index",
                    "only with n == 1 and no beam search (it names one sample of a larger request)", self.sample_index)
        if self.beam_width > 1:
            check_field(self.n <= self.beam_width, "n", "must be <= beam_width for beam search", self.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check_field(value is None or value >= 0, name, "must be >= 0", value)
        check_field(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)
        check_field(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0", self.stop_token_ids)
        check_field(self.early_stopping in (True, False, "never"), "early_stopping", "must be true, false or 'never'", self.early_stopping)
        check_field(abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
               f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]", self.length_penalty)
        if self.beam_width > 1:
            for name, off in BEAM_REFUSED:
                check_field(getattr(self, name) == off, name, "is not supported with beam search", getattr(self, name))
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)
        check_field(self.cache_salt is None or (isinstance(self.cache_salt, str) and len(self.cache_salt) <= MAX_CACHE_SALT),
                    "cache_salt", f"must be a string of at most {MAX_CACHE_SALT} characters", self.cache_salt)

    def _check_constraints(self) -> None:
        check_field(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
                    "structured_outputs", "must be a StructuredOutputs", type(self.structured_outputs).__name__)
        bias = self.logit_bias
        if bias is None:
            bias = ()
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        check_field(isinstance(bias, (list, tuple)), "logit_bias", "must map token ids to biases", bias)
        check_field(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens", len(bias))
        pairs: dict[int, float] = {}
        for pair in bias:
            check_field(isinstance(pair, (list, tuple)) and len(pair) == 2, "logit_bias", "must map token ids to biases",
                        pair)
            token, value = pair
            if isinstance(token, str) and token.strip().lstrip("-").isdigit():
                token = int(token)  # JSON object keys are strings: {"50256": -100}
            check_field(_is_int(token) and token >= 0, "logit_bias", "keys must be token ids >= 0", token)
            check_field(_is_number(value) and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1], "logit_bias",
                        f"biases must be numbers in [{LOGIT_BIAS_RANGE[0]:g}, {LOGIT_BIAS_RANGE[1]:g}]", value)
            pairs[int(token)] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs.items())))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def num_seqs(self) -> int:
        """Sequences this request runs at once at most (its share of max_num_seqs)."""
        return max(self.n, self.beam_width)


def continues_from_first_token(params: SamplingParams) -> bool:
    """Whether a request whose first token was sampled on another worker goes on from
    that token: the one rule, wherever a first token crosses (a KV transfer's plan, the
    decode worker's fallback after a lost transfer). Only one sequence without beam
    search can: n > 1 forks every sequence from the last prompt token, and beams need
    every candidate there, so the decode worker recomputes that token and samples
    itself. The token's logprobs, when asked, travel with it (the prefill worker
    computes them and answers them to the router)."""
    return params.n == 1 and not params.use_beam_search


def check_field(ok: bool, name: str, rule: str, value: object) -> None:
    """Raise ValueError "<name>: <rule>, got <value>" unless `ok`. The value is cut
    short: the message becomes a gRPC status, and a client's megabyte string must
    not make it one (nor fill a log)."""
    if not ok:
        raise ValueError(f"{name}: {rule}, got {short_repr(value)}")


def short_repr(value: object, limit: int = MAX_VALUE_REPR) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)

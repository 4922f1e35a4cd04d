"""Input processing: every check a request must pass before it may enter an engine.

`SamplingParams` checks what holds whatever the model (ranges, finite floats, beam
search combinations); this module checks what depends on the model and the server:
the vocabulary, the logprob cap, n / beam_width against max_n and max_num_seqs, stop
strings against the tokenizer and their sizes, the prompt against max_model_len.

The router calls `validate_sampling_params` with the same limits as its workers, so
a request it accepts is one every worker accepts; each failure is a ValueError whose
message starts with the field's name ("logprobs: ...").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.config import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N
from pdserve.engine.sampling_params import SamplingParams, check_field

# Characters of a request id, wherever one is named: a client's at the router, a worker's
# in the engine, a transfer's on the KV wire.
MAX_REQUEST_ID = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingLimits:
    vocab_size: int
    max_n: int = DEFAULT_MAX_N  # largest n and beam_width
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # largest logprobs and prompt_logprobs
    has_tokenizer: bool = True  # stop strings need one
    max_num_seqs: int | None = None  # sequences one step may run: a request's n / beam_width must fit


def validate_sampling_params(params: SamplingParams, limits: SamplingLimits) -> None:
    """Raise ValueError naming the first field this engine or server cannot serve."""
    check_field(params.n <= limits.max_n, "n", f"must be <= {limits.max_n} (max_n)", params.n)
    check_field(params.beam_width <= limits.max_n, "beam_width", f"must be <= {limits.max_n} (max_n)", params.beam_width)
    if limits.max_num_seqs is not None:
        name = "beam_width" if params.beam_width >= params.n else "n"
        check_field(params.num_seqs <= limits.max_num_seqs, name,
               f"runs {params.num_seqs} sequences at once, more than max_num_seqs={limits.max_num_seqs} "
               f"allows: it could never be scheduled", params.num_seqs)
    cap = min(limits.max_logprobs, limits.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        check_field(value is None or value <= cap, name,
               f"must be <= {cap} (max_logprobs {limits.max_logprobs}, vocabulary {limits.vocab_size})", value)
    check_field(not params.stop or limits.has_tokenizer, "stop", "stop strings need a tokenizer, and this model has none",
           params.stop)
    check_field(len(params.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings", len(params.stop))
    longest = max((len(s) for s in params.stop), default=0)
    check_field(longest <= MAX_STOP_STRING_CHARS, "stop", f"stop strings of at most {MAX_STOP_STRING_CHARS} characters",
           longest)
    check_field(len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids",
           len(params.stop_token_ids))
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    check_field(bad is None, "stop_token_ids", f"must be < vocab_size {limits.vocab_size}", bad)
    bad = next((t for t, _ in params.logit_bias if t >= limits.vocab_size), None)
    check_field(bad is None, "logit_bias", f"token ids must be < vocab_size {limits.vocab_size}", bad)


def validate_prompt(
    prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int,
    ids_field: str = "prompt_token_ids",
) -> None:
    """The prompt is non-empty, in the vocabulary, and leaves room for max_tokens
    (`ids_field`: what the caller's surface calls the token ids)."""
    check_field(len(prompt) > 0, "prompt", "must contain at least one token", len(prompt))
    check_field(len(prompt) < max_model_len, "prompt", f"{len(prompt)} tokens leave no room below max_model_len "
                f"{max_model_len}", len(prompt))
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    check_field(bad is None, ids_field, f"token outside the vocabulary [0, {vocab_size})", bad)
    check_field(params.resumed_tokens < len(prompt), "resumed_tokens",
                f"must be below the prompt's length ({len(prompt)} tokens)", params.resumed_tokens)
    if len(prompt) + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds max_model_len {max_model_len}"
        )

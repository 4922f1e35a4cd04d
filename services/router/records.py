"""What the router's front end takes and gives back, in no transport's framing.

    adapter (gRPC, HTTP)                         front end (frontend.py)
    --------------------                         -----------------------
    its request   -> Request(text | token_ids,  -> validate, admit, dispatch
                             sampling=Sampling(...), ...)
    its messages  <- SequenceOutput per sequence <- one per worker message and sequence
                     (text, token_ids, logprobs, finish_reason; on a sequence's
                      last: usage, timing, cumulative_logprob, prompt_logprobs)

Values are taken as the caller sent them (no check here): the front end's
validator refuses what is wrong, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.common.deadline import Deadline


@dataclass(frozen=True)
class Sampling:
    """Every field of engine.SamplingParams a caller may set; None (or empty): the
    engine's default. The names are the proto's SamplingOptions fields."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None  # 0: greedy
    top_k: int | None = None  # 0 or -1: off
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    logprobs: int | None = None  # top-k logprobs per generated token
    prompt_logprobs: int | None = None
    n: int | None = None
    beam_width: int | None = None  # > 1: beam search
    length_penalty: float | None = None
    early_stopping: str | None = None  # "true" | "false" | "never"
    sample_index: int | None = None  # n == 1: draw as sample i of a request with n > 1 (seeded)
    resumed_tokens: int | None = None  # the prompt's last N tokens are the sequence's own output


@dataclass(frozen=True)
class Request:
    """One generation request. Exactly one of `text` and `token_ids` is the prompt.

    `authorization` is the caller's credential as sent (`Bearer <key>`, gRPC metadata
    or HTTP header alike): with --salt-cache-by-key the front end names the caller's
    tenant from it. `deadline`: the caller's (None: it set none); the front end caps
    it at --request-timeout."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    sampling: Sampling = Sampling()
    model: str = ""  # empty: the served model
    request_id: str = ""  # empty: the router assigns one
    cache_salt: str = ""  # empty: none
    authorization: str = ""
    deadline: Deadline | None = None
    add_special_tokens: bool = True  # when `text` is tokenized (a chat template already wrote them)
    fill_context: bool = False  # max_tokens unset: as many as max_model_len leaves after the prompt


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and the requested top-k (token id, logprob), best first.
    `logprob` is None only for a prompt's first token (nothing predicts it)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # of this sequence
    cached_tokens: int  # prompt tokens served from a prefix cache
    # Speculative decoding over the whole request (every sequence), as counted by the
    # decode worker that finished it: draft tokens verified, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class Timing:
    ttft_seconds: float  # arrival at the router to the request's first token
    tpot_seconds: float  # mean time per output token of this sequence after its first
    e2e_seconds: float  # arrival to this sequence's last output


@dataclass(frozen=True)
class SequenceOutput:
    """What one sequence (a parallel sample, or a beam by rank) gained in one worker
    message: new text and tokens since its previous output. A sequence's last output
    has `finish_reason` ("stop" | "length" | "abort"), usage and timing; sequence 0's
    last carries the prompt logprobs, when asked."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked
    finish_reason: str | None = None  # None while the sequence runs
    usage: Usage | None = None
    timing: Timing | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

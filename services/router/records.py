"""What the router's front end takes and gives back, in no transport's framing.

    adapter (gRPC, HTTP)                         front end (frontend.py)
    --------------------                         -----------------------
    its request   -> Request(text | token_ids,  -> validate, admit, dispatch
                             sampling=SamplingParams(...), ...)
    its messages  <- SequenceOutput per sequence <- one per worker message and sequence
                     (text, token_ids, logprobs, finish_reason; on a sequence's
                      last: usage, timing, cumulative_logprob, prompt_logprobs)

Sampling is the engine's own SamplingParams, the router's one sampling type: an
adapter builds it from its framing (services/common/convert.py for gRPC, the HTTP
adapter's protocol.py), and its construction refuses a value out of range, naming
the field. The other values are taken as the caller sent them: the front end's
validator refuses what is wrong (the model, the prompt, limits), naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.common.deadline import Deadline


@dataclass(frozen=True)
class ResumedSequence:
    """What of one sequence reached the client before its stream broke (resume.py)."""

    index: int
    token_ids: tuple[int, ...]
    logprob_sum: float = 0.0  # the cumulative logprob of token_ids, as the router said it
    finish_reason: str | None = None  # it generated its last token already


@dataclass(frozen=True)
class Resume:
    """A request that continues a broken stream: the token its router issued and
    what arrived of each sequence."""

    token: bytes
    sequences: tuple[ResumedSequence, ...]


@dataclass(frozen=True)
class Request:
    """One generation request. Exactly one of `text` and `token_ids` is the prompt.

    `authorization` is the caller's credential as sent (`Bearer <key>`, gRPC metadata
    or HTTP header alike): with --salt-cache-by-key the front end names the caller's
    tenant from it. `deadline`: the caller's (None: it set none); the front end caps
    it at --request-timeout."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = SamplingParams()  # its cache_salt unused: the validator sets the job's
    model: str = ""  # empty: the served model
    request_id: str = ""  # empty: the router assigns one
    cache_salt: str = ""  # empty: none
    authorization: str = ""
    deadline: Deadline | None = None
    add_special_tokens: bool = True  # when `text` is tokenized (a chat template already wrote them)
    # The caller left max_tokens unset: sampling.max_tokens is only a cap, lowered to what
    # max_model_len leaves after the prompt.
    fill_context: bool = False
    resumable: bool = False  # say on each output what resuming the stream needs (resume_state)
    resume: Resume | None = None  # continue a broken stream (resume.py)


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
    resume_state: ResumeState | None = None  # the request asked to be resumable

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ResumeState:
    """What a resume of the stream sends back for this sequence (resume.py)."""

    token: bytes  # on the stream's first output only
    logprob_sum: float  # the sequence's cumulative logprob so far
    finish_reason: str | None  # it generated its last token

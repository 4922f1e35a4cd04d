"""What the engine hands back to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.errors import FailureKind


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    # per generated token: {token_id: logprob} for the top-k and the chosen token
    logprobs: list[dict[int, float]] | None = None


@dataclass(frozen=True)
class RequestTimes:
    """When a finished request went through each phase here (time.monotonic seconds).

        arrival ──queue──> scheduled ──prefill──> first_token ──decode──> finished

    A request whose prompt KV came from a prefill worker has `kv_committed` (then
    scheduled == kv_committed: it joins the batch at once) and arrival is its
    reservation. `first_token` is None when it finished without sampling one."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float
    kv_committed: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    times: RequestTimes | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "abort")
    failure: FailureKind | None = None  # how, with error: INTERNAL or NO_ROOM
    # Speculative decoding, over all its sequences: drafts scored, and those emitted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

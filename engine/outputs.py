"""What the engine hands back to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    # per generated token: {token_id: logprob} for the top-k and the chosen token
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "abort")

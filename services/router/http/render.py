"""The front end's SequenceOutputs in the OpenAI objects' shapes.

    completions   logprobs {tokens, token_logprobs, top_logprobs, text_offset}
    chat          logprobs {content: [{token, logprob, bytes, top_logprobs: [...]}]}
    both          usage {prompt_tokens, completion_tokens, total_tokens,
                         prompt_tokens_details: {cached_tokens}}
                  finish_reason "stop" | "length"

JSON has no infinity: a logprob of -inf (a token the sampler ruled out) is sent as
-9999.0, as vLLM does. A token is named by its text (special tokens included), or
`token_id:N` when the model has no tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.records import TokenLogprob

FLOOR_LOGPROB = -9999.0
FINISH_REASONS = ("stop", "length")
TokenText = Callable[[int], str]


def token_namer(tokenizer: Tokenizer | None) -> TokenText:
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return tokenizer.token_text


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def finish_of(reason: str) -> str:
    """A sequence's finish reason as OpenAI names it; a sequence the workers ended
    otherwise ("abort") failed, and so does its request."""
    if reason not in FINISH_REASONS:
        raise ServeError(Status.INTERNAL, f"a sequence ended without finishing ({reason})")
    return reason


class CompletionLogprobs:
    """One choice's completions-shaped logprobs, grown message by message (text
    offsets count from the start of the choice's text, the echoed prompt included)."""

    def __init__(self, name: TokenText, offset: int = 0) -> None:
        self.name = name
        self.offset = offset

    def of(self, entries: Sequence[TokenLogprob]) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for entry in entries:
            text = self.name(entry.token_id)
            tokens.append(text)
            values.append(None if entry.logprob is None else finite(entry.logprob))
            if entry.logprob is None:
                tops.append(None)
            else:
                top = {self.name(t): finite(lp) for t, lp in entry.top}
                top.setdefault(text, finite(entry.logprob))
                tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob], name: TokenText, top_k: int) -> list[dict]:
    """Chat's `logprobs.content` entries; `top_k` alternatives each (the request's top_logprobs)."""
    content = []
    for entry in entries:
        text = name(entry.token_id)
        top = [_chat_entry(name(t), lp) for t, lp in entry.top[:top_k]]
        content.append({**_chat_entry(text, entry.logprob or 0.0), "top_logprobs": top})
    return content


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8", "replace"))}


def prompt_logprobs(entries: Sequence[TokenLogprob], name: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing predicts
    it), else {token id: {logprob, decoded_token}} for the token and its top alternatives."""
    out: list[dict | None] = []
    for entry in entries:
        if entry.logprob is None:
            out.append(None)
            continue
        ranked = {str(t): {"logprob": finite(lp), "decoded_token": name(t)} for t, lp in entry.top}
        ranked.setdefault(str(entry.token_id), {"logprob": finite(entry.logprob), "decoded_token": name(entry.token_id)})
        out.append(ranked)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }

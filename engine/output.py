"""Output processing: sampled tokens -> sequence state, stop decisions, token deltas;
finished groups -> `RequestOutput`s.

A token is appended, its logprobs recorded, its text decoded (`engine/text.py`, the
stop-string implementation the router shares), then the sequence's stop is decided:
EOS / stop ids / max_tokens (`Request.check_stop`) or a stop string. Streaming
callers hear of each token through `token_hook` before `step()` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.beam import BeamSearch, Hypothesis
from pdserve.engine.group import SequenceGroup
from pdserve.engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.text import SequenceText
from pdserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenDelta:
    """One token just appended to a sequence, for streaming (see `LLMEngine.token_hook`).

    Told for every sampled token of plain and parallel-sampled requests, in the order
    they are appended (a preempted sequence recomputes its KV but never re-emits).
    Beam search emits none: beams reorder until the end, so its tokens are only final
    in the `RequestOutput` that `step()` returns."""

    request_id: str  # the request given to add_request (not the forked sequence's id)
    index: int  # which of the request's parallel samples
    token_id: int
    logprob: float | None  # of the chosen token; None when not computed here (commit_remote)
    top_logprobs: dict[int, float] | None  # when the request asked for logprobs
    finish_reason: str | None  # "stop" / "length" when this token ended the sequence


TokenHook = Callable[[TokenDelta], None]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.token_hook: TokenHook | None = None
        self._texts: dict[str, SequenceText] = {}

    # -- sequences ----------------------------------------------------------------------

    def track(self, seq: Request, group: SequenceGroup) -> None:
        """Follow a new sequence's text (beams have none until they end)."""
        if self.tokenizer is None or group.beam is not None:
            return
        params = seq.sampling_params
        text = SequenceText(self.tokenizer, seq.prompt_token_ids, params.stop, params.min_tokens)
        for token in seq.output_token_ids:
            text.append(token)
        self._texts[seq.request_id] = text

    def untrack(self, seq: Request) -> None:
        """The sequence ended: its final text."""
        text = self._texts.pop(seq.request_id, None)
        if text is not None:
            seq.text = text.finish()

    def append(
        self, group: SequenceGroup, seq: Request, token: int, logprob: float | None, top: dict[int, float] | None,
        complete: bool = False,
    ) -> RequestStatus | None:
        """Append a sampled token; the finished status it brings the sequence to, if any
        (`complete`: the token completed the request's grammar, a stop)."""
        seq.append_token(token)
        seq.first_token_time = seq.first_token_time or time.monotonic()
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if top is not None:
            seq.logprobs.append({**top, token: logprob})
        text = self._texts.get(seq.request_id)
        stop_string = text is not None and text.append(token)
        if text is not None:
            seq.text = text.text
        if complete:  # the grammar allows nothing more: a stop, even at max_tokens
            status: RequestStatus | None = RequestStatus.FINISHED_STOPPED
        else:
            status = seq.check_stop() or (RequestStatus.FINISHED_STOPPED if stop_string else None)
        if self.token_hook is not None:
            self.token_hook(TokenDelta(
                group.request_id, seq.sample_index, token, logprob, top, status.value if status else None,
            ))
        return status

    # -- prompt logprobs ------------------------------------------------------------------

    @staticmethod
    def record_prompt_logprobs(group: SequenceGroup, request: Request, logits: torch.Tensor) -> None:
        """Row j of `logits` scores the token after position num_computed + j; keep each
        score of a prompt token not recorded yet (a recomputed or forked sequence
        scores the same prompt again)."""
        entries = group.prompt_logprobs
        start = request.num_computed_tokens
        if entries is None or len(entries) < start + 1:
            return
        lo, hi = len(entries) - start - 1, min(logits.shape[0], request.num_prompt_tokens - start - 1)
        if hi <= lo:
            return
        logprobs = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        targets = request.token_ids[start + lo + 1 : start + hi + 1]
        actual = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None]).squeeze(1).tolist()
        k = request.sampling_params.prompt_logprobs or 0
        values, ids = logprobs.topk(k, dim=-1)
        for token, lp, top_ids, top_values in zip(targets, actual, ids.tolist(), values.tolist()):
            entries.append({**dict(zip(top_ids, top_values)), token: lp})

    # -- outputs --------------------------------------------------------------------------

    def build(self, group: SequenceGroup) -> RequestOutput:
        """The finished group's output: samples by index, or the n best beams, best first."""
        if group.beam is not None:
            completions = self._beam_completions(group, group.beam)
        else:
            completions = [
                CompletionOutput(
                    s.sample_index, s.output_token_ids, s.text, s.status.value, s.cumulative_logprob,
                    s.logprobs if s.sampling_params.logprobs is not None else None,
                )
                for s in sorted(group.finished, key=lambda s: s.sample_index)
            ]
        first = group.finished[0] if group.finished else None
        return RequestOutput(
            group.request_id, None, group.prompt_token_ids, completions, finished=True,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            prompt_logprobs=group.prompt_logprobs if group.params.prompt_logprobs is not None else None,
            error=group.error, failure=group.failure, times=request_times(group.finished),
            num_draft_tokens=sum(s.num_draft_tokens for s in group.finished),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in group.finished),
        )

    def _beam_completions(self, group: SequenceGroup, beam: BeamSearch) -> list[CompletionOutput]:
        ranked = group.beams_at_abort
        if ranked is None:
            ranked = [(h, True) for h in beam.results(group.params.n)]
        eos = beam.eos_token_ids
        return [
            CompletionOutput(i, h.token_ids, self._decode(h.token_ids), _beam_reason(h, ended, eos), h.sum_logprob)
            for i, (h, ended) in enumerate(ranked)
        ]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""


def _beam_reason(h: Hypothesis, ended: bool, eos: tuple[int, ...]) -> str:
    if not ended:
        return RequestStatus.FINISHED_ABORTED.value
    return "stop" if h.token_ids and h.token_ids[-1] in eos else "length"


def request_times(seqs: list[Request]) -> RequestTimes:
    """A finished request's phases from its sequences (forks inherit their parent's times)."""

    def earliest(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return min(present) if present else None

    return RequestTimes(
        arrival=min((s.arrival_time for s in seqs), default=time.monotonic()),
        scheduled=earliest([s.first_scheduled_time for s in seqs]),
        first_token=earliest([s.first_token_time for s in seqs]),
        finished=time.monotonic(),
        kv_committed=earliest([s.kv_committed_time for s in seqs]),
    )

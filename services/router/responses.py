"""Worker updates (events.py) -> the front end's SequenceOutputs: incremental text, timing, usage.

Text comes from the engine's `SequenceText` per sequence, the implementation the
engine stops with (a multi-byte character is never split: it waits for its last
byte's token). With stop strings, the last `max(len(stop)) - 1` characters are held
back while the sequence runs, so text sent never includes a stop string that only
completes later; the final message cuts where the engine cut.

    ttft  arrival at the router -> the request's first token leaving the router
    tpot  (last token - first token of the sequence) / (its tokens - 1)
    e2e   arrival -> the sequence's last message
Beam search streams nothing (beams reorder until the end): one message per beam.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve.engine.detokenizer import Decoder
from pdserve.engine.text import SequenceText
from pdserve.services.common.metrics import Disabled, RouterMetrics
from pdserve.services.router.events import Finished, Result, Update
from pdserve.services.router.records import ResumeState, SequenceOutput, Timing, TokenLogprob, Usage
from pdserve.services.router.validate import Job


@dataclass
class _Sequence:
    text: SequenceText | None  # None: the model has no tokenizer
    num_tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None
    logprob_sum: float = 0.0  # of its tokens so far, as its cumulative logprob counts them
    finish_reason: str | None = None  # it generated its last token (a resumable request's state)
    resumed: int = 0  # tokens the client had before a resume (not timed here)

    def add(self, token_ids: Sequence[int], now: float) -> None:
        if not token_ids:
            return
        self.first_at = self.first_at or now
        self.last_at = now
        self.num_tokens += len(token_ids)
        if self.text is not None:
            for t in token_ids:
                self.text.append(t)

    def running_text(self) -> str:
        """New text that no stop string can still claim."""
        return self.text.emit() if self.text is not None else ""

    def final_text(self) -> str:
        return self.text.emit(final=True) if self.text is not None else ""


class ResponseBuilder:
    def __init__(
        self, job: Job, tokenizer: Decoder | None, arrival: float, metrics: RouterMetrics | None = None,
        resume_token: bytes | None = None,
    ) -> None:
        """`resume_token`: the request asked to be resumable (resume.py): every output
        carries its sequence's resume state, the first one this token. A resumed job
        (`job.resumed`) starts each sequence after the tokens the client has: its text
        as far as the broken stream had sent it, its counts and logprob sum."""
        self.job = job
        self._resume_token = resume_token
        self.metrics = metrics or Disabled()
        self._streamed = not job.params.use_beam_search  # beams arrive whole at the end
        self.tokenizer = tokenizer
        self.arrival = arrival
        self.first_token_at: float | None = None
        self.cached_tokens = 0
        self._seqs: dict[int, _Sequence] = {}
        for resumed in job.resumed or ():
            seq = self._seq(resumed.index)
            seq.num_tokens = seq.resumed = len(resumed.token_ids)
            seq.logprob_sum = resumed.logprob_sum
            seq.finish_reason = resumed.finish_reason
            if seq.text is not None:
                for t in resumed.token_ids:
                    seq.text.append(t)
                seq.text.emit()  # what the broken stream had sent of it

    def note_cached_tokens(self, n: int) -> None:
        self.cached_tokens = max(self.cached_tokens, n)

    def messages(self, update: Update) -> list[SequenceOutput]:
        """The outputs of one worker update, one per sequence index (in order) that
        gained text or tokens, or finished."""
        now = time.monotonic()
        out: dict[int, SequenceOutput] = {}
        for tokens in update.tokens:
            seq = self._seq(tokens.index)
            self._add(seq, tokens.token_ids, now)
            if self._resume_token is not None:  # only a resumable stream says these
                seq.logprob_sum += sum(tokens.token_logprobs) if tokens.token_logprobs else sum(
                    e.logprob or 0.0 for e in tokens.logprobs)
                seq.finish_reason = seq.finish_reason or tokens.finish_reason
            _grow(out, tokens.index, tokens.token_ids, tokens.logprobs, seq.running_text())
        self._first_tokens(any(t.token_ids for t in update.tokens), now)
        end = update.end
        if end is not None:
            self.note_cached_tokens(end.num_cached_tokens)
            self._first_tokens(any(r.token_ids for r in end.results), now)
            for result in end.results:
                seq = self._seq(result.index)
                self._add(seq, result.token_ids, now)
                seq.finish_reason = result.finish_reason or "abort"
                _grow(out, result.index, result.token_ids)
                out[result.index] = self._finish(out[result.index], seq, result, end, now)
            if end.prompt_logprobs and 0 in out:
                out[0] = replace(out[0], prompt_logprobs=end.prompt_logprobs)
            self.metrics.request_finished(now - self.arrival)
        outputs = [out[i] for i in sorted(out) if out[i].token_ids or out[i].text or out[i].finished]
        return outputs if self._resume_token is None else self._with_resume_state(outputs)

    def _with_resume_state(self, outputs: list[SequenceOutput]) -> list[SequenceOutput]:
        """Each output with its sequence's resume state; the token on the stream's first."""
        stated = []
        for output in outputs:
            seq = self._seqs[output.index]
            token, self._resume_token = self._resume_token or b"", b""
            stated.append(replace(output, resume_state=ResumeState(token, seq.logprob_sum, seq.finish_reason)))
        return stated

    def _add(self, seq: _Sequence, token_ids: Sequence[int], now: float) -> None:
        previous = seq.last_at
        seq.add(token_ids, now)
        self.metrics.tokens(len(token_ids), previous, now, self._streamed)

    def _first_tokens(self, seen: bool, now: float) -> None:
        if seen and self.first_token_at is None:
            self.first_token_at = now
            self.metrics.first_token(now - self.arrival, len(self.job.prompt))

    def _seq(self, index: int) -> _Sequence:
        seq = self._seqs.get(index)
        if seq is None:
            params = self.job.params
            text = SequenceText(self.tokenizer, self.job.prompt, params.stop, params.min_tokens) if self.tokenizer else None
            seq = self._seqs[index] = _Sequence(text)
        return seq

    def _finish(self, output: SequenceOutput, seq: _Sequence, result: Result, last: Finished,
                now: float) -> SequenceOutput:
        """Sequence `result`'s last output; `last` is the request's end (its
        request-wide counts go into every sequence's usage)."""
        reason = result.finish_reason or "abort"
        first = self.first_token_at or seq.first_at or now
        timed = seq.num_tokens - seq.resumed
        tpot = (seq.last_at - seq.first_at) / (timed - 1) if timed > 1 else 0.0
        self.metrics.sequence_finished(reason, tpot if self._streamed and timed > 1 else None)
        return replace(
            output, text=output.text + seq.final_text(), finish_reason=reason,
            cumulative_logprob=result.cumulative_logprob,
            usage=Usage(prompt_tokens=len(self.job.prompt), completion_tokens=seq.num_tokens,
                        cached_tokens=self.cached_tokens, num_draft_tokens=last.num_draft_tokens,
                        num_accepted_tokens=last.num_accepted_tokens),
            timing=Timing(ttft_seconds=first - self.arrival, tpot_seconds=tpot, e2e_seconds=now - self.arrival),
        )


def _grow(out: dict[int, SequenceOutput], index: int, token_ids: tuple[int, ...],
          logprobs: tuple[TokenLogprob, ...] = (), text: str = "") -> None:
    """Add to sequence `index`'s output of this message."""
    current = out.get(index) or SequenceOutput(index)
    out[index] = replace(current, text=current.text + text, token_ids=current.token_ids + token_ids,
                         logprobs=current.logprobs + logprobs)

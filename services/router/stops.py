"""Stop strings over a migrated sequence's whole output.

    sent before the migration          the continuation's worker
    |<------ s1 .. sk ------>|<-------- t1 t2 t3 ... -------->|
              "x + 1\\n"       "\\npr" completes the stop "x + 1\\n\\npr"

The continuation's worker matches stop strings in its own text, which starts after
its prompt (the original prompt plus s1..sk): a stop string that began in the
tokens sent before is invisible to it. `StopWatch` runs the engine's `SequenceText`
(engine/text.py, as the engine matches them) over the whole output on the router
and ends the sequence where the uninterrupted run would have: the update is cut
after the token that completes the stop string, its sequence ends ("stop"), and the
caller ends the request (the worker's call is then cancelled).

Only a continuation of a request with stop strings needs one (`stop_watch`); a
worker that ends at the same token itself passes through unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.engine.detokenizer import Decoder
from pdserve.engine.text import SequenceText
from pdserve.services.router.events import Update
from pdserve.services.router.validate import Job


class StopWatch:
    """The stop strings of sequence 0 of `job`, after `sent` reached the client."""

    def __init__(self, tokenizer: Decoder, job: Job, sent: list[int]) -> None:
        self._text = SequenceText(tokenizer, job.prompt, job.params.stop, job.params.min_tokens)
        for token in sent:
            self._text.append(token)

    def cut(self, update: Update) -> Update | None:
        """`update` cut after the token that completes a stop string its worker did not
        end at: that token ends sequence 0 ("stop"), and the update is no longer the
        worker's final one. None when `update` completes no such stop string (it goes
        on as it is)."""
        for position, tokens in enumerate(update.tokens):
            if tokens.index != 0:
                continue
            for i, token in enumerate(tokens.token_ids):
                if not self._text.append(token):
                    continue
                if i == len(tokens.token_ids) - 1 and tokens.finish_reason:
                    return None  # the worker ended there too
                kept = (*update.tokens[:position], tokens.cut_after(i), *update.tokens[position + 1:])
                return replace(update, tokens=kept, end=None)
        return None


def stop_watch(tokenizer: Decoder | None, job: Job, sent: list[int], migrated: bool) -> StopWatch | None:
    """The watch a continuation of `job` needs after `sent` (None: no migration, no
    stop strings or no tokenizer to match them with)."""
    if not migrated or not job.params.stop or tokenizer is None:
        return None
    return StopWatch(tokenizer, job, sent)

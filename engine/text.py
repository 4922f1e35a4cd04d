"""The text of one generated sequence as its tokens arrive, and its stop strings.

The one implementation the engine (which decides where a sequence stops) and the
router (which streams the text to the client) share, so both cut at the same place.

Stop strings are matched on text, so one may span tokens. Semantics, as vLLM's:

* a stop string counts only once the sequence has more than `min_tokens` tokens
  (the tokens EOS and stop ids are masked for cannot end it either);
* it must end inside the text the newest token completed, so a stop string that lay
  entirely in earlier text (before min_tokens) never ends the sequence later;
* the earliest match wins, and the text is cut where it starts (it and everything
  after it are not part of the output).

    text      ... already checked ...|<-- new text of this token -->|
    search         <- len(stop) - 1 ->^ a match must end in here

While the sequence runs, `emit()` hands out only text that no stop string can still
claim: the last max(len(stop)) - 1 characters wait for the next token.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.detokenizer import Decoder, IncrementalDetokenizer


class SequenceText:
    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str] = (), min_tokens: int = 0
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, list(prompt_token_ids))
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.stopped = False  # a stop string matched: `text` ends where it began
        self._cut: int | None = None
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._emitted = 0
        self._flushed = False

    @property
    def text(self) -> str:
        """The text so far (cut at the stop string once one matched)."""
        text = self._detok.text
        return text if self._cut is None else text[: self._cut]

    def append(self, token_id: int) -> bool:
        """Add one token; True when it completes a stop string (the text is cut there).
        Tokens after a stop are ignored."""
        if self.stopped:
            return True
        self.num_tokens += 1
        new = self._detok.append(token_id)
        return self._check(len(new))

    def finish(self) -> str:
        """The sequence ended: flush any held-back partial character; the final text."""
        if not self.stopped and not self._flushed:
            self._flushed = True
            self._check(len(self._detok.flush()))
        return self.text

    def emit(self, final: bool = False) -> str:
        """Text not handed out yet: all of it when `final`, else only what no stop
        string can still claim."""
        text = self.finish() if final else self.text
        upto = len(text) if final or self.stopped else len(text) - self._holdback
        if upto <= self._emitted:
            return ""
        new = text[self._emitted : upto]
        self._emitted = upto
        return new

    def _check(self, num_new: int) -> bool:
        if not num_new or not self.stop or self.num_tokens <= self.min_tokens:
            return False
        text = self._detok.text
        hits = [text.find(s, max(0, len(text) - num_new - len(s) + 1)) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if not hits:
            return False
        self._cut = min(hits)
        self.stopped = True
        return True

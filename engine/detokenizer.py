"""Incremental detokenization that never splits a multi-byte character.

Decoding token by token breaks words that span tokens (byte-level BPE pieces of one
UTF-8 character, sentencepiece's leading spaces). Instead keep two offsets into the
token list:

    tokens   ... [prefix_offset ........ read_offset ........ end]
                  <- already emitted ->  <- not yet emitted ->

and emit `decode(tokens[prefix:]) - decode(tokens[prefix:read])`, holding back while
the new text ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as left context, so the first output token decodes with the
# spacing it has in context.
_CONTEXT = 6


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; returns the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += new
        return new

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        if self.read_offset == len(self.tokens):
            return ""
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        new = self.tokenizer.decode(self.tokens[self.prefix_offset :])[len(prefix) :]
        self.read_offset = len(self.tokens)
        self.text += new
        return new

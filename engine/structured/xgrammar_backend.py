"""The xgrammar backend (the default): JSON schema, any JSON object, regex, choice (as a
regex of its escaped strings) and GBNF/EBNF grammars, compiled for one vocabulary.

Rollback (speculative drafts, manager.py): xgrammar 0.2.9's matcher rolls back any number
of tokens (its `max_rollback_tokens` is deprecated, always unlimited), so none is set.

The JSON kinds' masks are also ANDed with a static row refusing tokens that hold a raw
control byte: xgrammar 0.2.9 lets strings with a maxLength take them, JSON does not."""

from __future__ import annotations

import re
from typing import Any

import torch

from pdserve.engine.structured.backend import GrammarBackend, Vocabulary, choice_regex
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs

# Compact JSON, as llguidance writes it without flexible whitespace: no free whitespace
# (a model cannot pad its output forever), "," and ":" alone.
SEPARATORS = (",", ":")


class XGrammarMatcher:
    def __init__(self, matcher: Any, only: torch.Tensor | None = None) -> None:
        self._m = matcher
        self._only = only  # a bitmask row ANDed into every mask (JSON: no raw control bytes)

    def accept_token(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)
        if self._only is not None:
            bitmask[index] &= self._only

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._m.fork(), self._only)


class XGrammarCompiled:
    def __init__(self, compiled: Any, stop_token_ids: list[int], only: torch.Tensor | None) -> None:
        self._compiled = compiled
        self._stop = stop_token_ids
        self._only = only

    def matcher(self) -> XGrammarMatcher:
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self._compiled, override_stop_tokens=self._stop or None)
        return XGrammarMatcher(matcher, self._only)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocab: Vocabulary) -> None:
        super().__init__(vocab)
        import xgrammar

        # The vocabulary type (byte-level BPE, byte fallback, raw) as xgrammar reads it
        # from the tokenizer's own JSON, as its from_huggingface does for fast tokenizers.
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(vocab.tokenizer_json)
        info = xgrammar.TokenizerInfo(
            vocab.encoded_vocab(), meta["vocab_type"], vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.eos_token_ids) or None, add_prefix_space=meta["add_prefix_space"],
        )
        # No cache of its own: compiler.py keeps one, keyed by the constraint and vocabulary.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._json_only = _without_control_bytes(info.decoded_vocab, vocab.vocab_size)

    def compile(self, constraint: StructuredOutputs) -> XGrammarCompiled:
        kind, c = constraint.kind, self._compiler
        try:
            if kind is ConstraintKind.JSON_SCHEMA:
                compiled = c.compile_json_schema(constraint.spec, any_whitespace=False, separators=SEPARATORS,
                                                 strict_mode=True)
            elif kind is ConstraintKind.JSON_OBJECT:
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=SEPARATORS,
                                                 strict_mode=False)
            elif kind is ConstraintKind.REGEX:
                compiled = c.compile_regex(constraint.spec)
            elif kind is ConstraintKind.CHOICE:
                compiled = c.compile_regex(choice_regex(constraint.choices))
            else:
                compiled = c.compile_grammar(constraint.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs.{kind.value}: xgrammar refused it: {_first_line(exc)}") from None
        json_kind = kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT)
        return XGrammarCompiled(compiled, list(self.vocab.eos_token_ids), self._json_only if json_kind else None)


def _without_control_bytes(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing every token but those holding a byte below 0x20. xgrammar
    0.2.9's JSON strings admit raw control characters (a random model wrote "\x1a"),
    which JSON forbids (they must be escaped); compact JSON has no whitespace outside
    strings either, so no valid output of a JSON kind holds such a byte."""
    row = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    for token, text in enumerate(decoded_vocab[:vocab_size]):
        if any(b < 0x20 for b in text):
            word, bit = divmod(token, 32)
            row[word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF
    return row


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its time stamp and source location ("[12:00:00]
    /project/cpp/x.cc:94: ..."), on one line."""
    text = re.sub(r"^\s*\[[^\]]*\]\s*", "", str(exc))
    text = re.sub(r"^\S+\.(cc|h|cpp):\d+:\s*", "", text)
    return " ".join(text.split())[:500]

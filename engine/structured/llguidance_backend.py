"""The llguidance backend: JSON schema, any JSON object, regex, choice (as a regex of its
escaped strings) and Lark grammars, for one vocabulary.

llguidance has no separate compile step: building a matcher checks and prepares the
grammar (it drops the GIL while it does). So compiling builds one matcher off the
step, and each sequence's matcher is a deep copy of it. Its `rollback` undoes any
number of consumed tokens (speculative drafts, manager.py); nothing to set for it."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.errors import ConstraintError
from pdserve.engine.structured.backend import GrammarBackend, Vocabulary, choice_regex
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs

# Compact JSON (no free whitespace): a model cannot pad its output forever.
JSON_OPTIONS = {"whitespace_flexible": False}


class LLGuidanceMatcher:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        if self._m.validate_tokens([token]) == 1 and self._m.consume_token(token):
            return True
        self._check()
        return False  # refused without consuming it (consume_token would break the matcher)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self._check()

    def _check(self) -> None:
        """A matcher in its error state gave up on the grammar (a resource limit, e.g. an
        endlessly recursive schema): the request's constraint fails, not the engine."""
        if self._m.is_error():
            reason = " ".join(self._m.get_error().split())[:300]
            raise ConstraintError(f"structured_outputs: llguidance gave up on the grammar: {reason}")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())


class LLGuidanceCompiled:
    def __init__(self, prototype: Any) -> None:
        self._prototype = prototype  # never advanced: only copied

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._prototype.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, vocab: Vocabulary) -> None:
        super().__init__(vocab)
        import llguidance

        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(
            vocab.tokenizer_json, n_vocab=vocab.vocab_size, eos_token=list(vocab.eos_token_ids) or None)

    def compile(self, constraint: StructuredOutputs) -> LLGuidanceCompiled:
        matcher_cls, kind = self._llg.LLMatcher, constraint.kind
        try:
            if kind is ConstraintKind.JSON_SCHEMA:
                grammar = matcher_cls.grammar_from_json_schema(constraint.spec, defaults=JSON_OPTIONS)
            elif kind is ConstraintKind.JSON_OBJECT:
                grammar = matcher_cls.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
            elif kind is ConstraintKind.REGEX:
                grammar = matcher_cls.grammar_from_regex(constraint.spec)
            elif kind is ConstraintKind.CHOICE:
                grammar = matcher_cls.grammar_from_regex(choice_regex(constraint.choices))
            else:
                grammar = matcher_cls.grammar_from_lark(constraint.spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs.{kind.value}: llguidance refused it: {exc}") from None
        matcher = matcher_cls(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            reason = " ".join(matcher.get_error().split())[:500]
            raise ValueError(f"structured_outputs.{kind.value}: llguidance refused it: {reason}")
        return LLGuidanceCompiled(matcher)

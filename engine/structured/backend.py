"""One interface to the grammar engines (xgrammar, llguidance), and the vocabulary they
compile against.

    GrammarBackend.compile(StructuredOutputs) -> CompiledGrammar      (off the step: compiler.py)
    CompiledGrammar.matcher()                 -> GrammarMatcher       (one per sequence)
    GrammarMatcher: fill_bitmask -> the model samples -> accept_token -> ... -> is_terminated

A token mask is xgrammar's and llguidance's common layout: an int32 tensor of
ceil(vocab_size / 32) words per row, bit j of word i allowing token 32 * i + j
(`allocate_bitmask`, `apply_bitmask`). `vocab_size` is the model's (its logits' width):
ids the tokenizer does not have (padding rows of the embedding) are never allowed.

Termination: a grammar ends the request when its matcher `is_terminated()` (nothing,
or only a stop token, may follow). The engine's EOS ids are the grammars' stop tokens,
so a masked step may pick EOS exactly where the grammar is complete.
"""

from __future__ import annotations

import abc
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pdserve.engine.structured.params import StructuredOutputs


@dataclass(frozen=True)
class Vocabulary:
    """What a grammar compiles against: the tokenizer (tokenizer.json's text, with the
    special tokens tokenizer_config.json adds), the model's vocab_size and its EOS ids."""

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of everything a compiled grammar depends on (the compile cache's key)."""
        text = f"{self.vocab_size};{self.eos_token_ids};{self.tokenizer_json}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def encoded_vocab(self) -> list[str]:
        """Token id -> its text as the tokenizer stores it ("" for ids it lacks)."""
        from tokenizers import Tokenizer as Backend

        vocab = Backend.from_str(self.tokenizer_json).get_vocab(with_added_tokens=True)
        encoded = [""] * self.vocab_size
        for token, index in vocab.items():
            if index < self.vocab_size:
                encoded[index] = token
        return encoded

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Vocabulary:
        """From a model directory's tokenizer.json (the `tokenizers` library, never transformers)."""
        from pdserve.engine.tokenizer import load_backend

        backend = load_backend(Path(model_dir))
        if backend is None:
            raise ValueError(f"structured_outputs: {model_dir} has no tokenizer.json, which constrained decoding needs")
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), vocab_size, tuple(eos_token_ids))


class GrammarMatcher(Protocol):
    """One sequence's place in its grammar. Never raises for a token the grammar refuses."""

    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row `index` of a CPU bitmask."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected drafts)."""
        ...

    def is_terminated(self) -> bool:
        """The output is complete: nothing, or only a stop token, may follow."""
        ...

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same place (a parallel sample)."""
        ...


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        ...


class GrammarBackend(abc.ABC):
    """Compiles constraints for one vocabulary. `compile` is thread-safe and raises
    ValueError with the backend's reason when the constraint is refused."""

    name: str

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab

    @abc.abstractmethod
    def compile(self, constraint: StructuredOutputs) -> CompiledGrammar: ...


def choice_regex(choices: tuple[str, ...]) -> str:
    """CHOICE as a regex: the strings, escaped, as alternatives."""
    return "(" + "|".join(_escape(c) for c in choices) + ")"


def _escape(text: str) -> str:
    # re.escape leaves some characters (e.g. '-', '/') that grammar engines' regex
    # dialects may treat specially inside classes; escaping every non-alphanumeric
    # ASCII character is valid in both dialects.
    return "".join(f"\\{c}" if c.isascii() and not c.isalnum() and c not in " _" else c for c in text)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, ceil(vocab_size / 32)] int32 mask allowing every token."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: which tokens are allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bitmask row i does not allow token t."""
    if not rows:
        return
    allowed = bitmask_to_bool(bitmask.to(logits.device), logits.shape[1])
    if rows == list(range(logits.shape[0])):  # every row constrained: in place, no gather
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    picked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    logits.index_copy_(0, index, picked)

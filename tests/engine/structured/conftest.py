"""Shared by the structured-outputs tests: the embedded model's vocabulary, its token
texts, and each backend built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.structured.backend import Vocabulary
from pdserve.engine.structured.build import make_backend

# Wider than the tokenizer's 4096: padding rows of an embedding, never allowed.
VOCAB_SIZE = 4100
EOS = 1


@pytest.fixture(scope="session")
def vocab() -> Vocabulary:
    return Vocabulary.from_model_dir(Path(DEFAULT_MODEL), VOCAB_SIZE, (EOS,))


@pytest.fixture(scope="session")
def token_texts(vocab) -> list[str | None]:
    """Each id's text (None: special, or not in the tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(vocab.tokenizer_json)
    size = tok.get_vocab_size(with_added_tokens=True)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return [None if i >= size or tok.id_to_token(i) in special else tok.decode([i], skip_special_tokens=False)
            for i in range(VOCAB_SIZE)]


@pytest.fixture(scope="session", params=["xgrammar", "llguidance"])
def backend(request, vocab):
    return make_backend(request.param, vocab)

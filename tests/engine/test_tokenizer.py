"""engine/tokenizer.py decodes (and encodes) with the `tokenizers` library where
transformers' generic tokenizer would decode (and encode) the same: held to
transformers' own `decode` and `encode` on the embedded model and on tokenizer
directories built to differ (special tokens named only in tokenizer_config.json,
extra special tokens, clean-up asked of a BPE model, settings that change encoding);
any other tokenizer class goes through transformers itself."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.tokenizer import Tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ✓ 🙂", "  leading and trailing  ", "<s>class </s>A<pad>"]


def _copy(tmp_path: Path, config_changes: dict) -> Path:
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL) / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _agree(model_dir: Path | str) -> Tokenizer:
    ours, theirs = Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)
    vocab = len(theirs)
    samples = [theirs.encode(t) for t in TEXTS]
    samples += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    samples += [[i] for i in range(min(vocab, 300))] + [[i] for i in range(vocab - 50, vocab)]
    for ids in samples:
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids
    for i in range(vocab):
        assert ours.token_text(i) == theirs.decode([i], skip_special_tokens=False), i
    texts = TEXTS + [theirs.decode(ids, skip_special_tokens=False) for ids in samples[len(TEXTS):len(TEXTS) + 200]]
    specials = [t for t in theirs.all_special_tokens if t]
    texts += [f"{rng.choice(TEXTS)}{rng.choice(specials)} {rng.choice(TEXTS)}" for _ in range(50)]
    texts += ["", " ", "\n\n", "\t x", "A" * 300]
    for text in texts:
        assert ours.encode(text) == list(theirs.encode(text)), text
        assert ours.encode(text, add_special_tokens=False) == list(theirs.encode(text, add_special_tokens=False)), text
    return ours


def test_the_embedded_model_decodes_and_encodes_as_transformers_without_loading_it() -> None:
    tok = _agree(DEFAULT_MODEL)
    assert tok._decoder is not None and tok._encoder is not None  # the direct paths were taken
    tok.load()  # what a router without chat loads: still not transformers
    assert tok._hf is None


@pytest.mark.parametrize("changes", [
    {"unk_token": "oo", "sep_token": {"content": "def", "lstrip": False, "__type": "AddedToken"}},  # in the vocab, not added
    {"extra_special_tokens": ["<tool>", "ret"]},  # a new token and one of the vocabulary
    {"clean_up_tokenization_spaces": True},  # BPE: transformers skips the clean-up
])
def test_special_tokens_named_only_in_the_config_are_skipped_alike(tmp_path: Path, changes: dict) -> None:
    tok = _agree(_copy(tmp_path, changes))
    assert tok._decoder is not None
    # a special token given with its flags (lstrip, ...) may split text otherwise: transformers encodes
    assert (tok._encoder is None) == isinstance(changes.get("sep_token"), dict)


@pytest.mark.parametrize("changes", [
    {"add_bos_token": True}, {"add_eos_token": True}, {"add_prefix_space": True}, {"split_special_tokens": True},
])
def test_settings_that_change_encoding_leave_it_to_transformers(tmp_path: Path, changes: dict) -> None:
    tok = _agree(_copy(tmp_path, changes))
    assert tok._decoder is not None and tok._encoder is None


@pytest.mark.parametrize("changes", [{"tokenizer_class": "LlamaTokenizer"}, {"added_tokens_decoder": {}}])
def test_any_other_tokenizer_decodes_through_transformers(tmp_path: Path, changes: dict) -> None:
    model_dir = _copy(tmp_path, changes)
    tok = Tokenizer(model_dir)
    assert tok._decoder is None
    theirs = AutoTokenizer.from_pretrained(str(model_dir))
    ids = theirs.encode(TEXTS[1])
    assert tok.decode(ids) == theirs.decode(ids, skip_special_tokens=True)

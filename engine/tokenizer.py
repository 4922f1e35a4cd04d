"""The model's own tokenizer (Hugging Face files next to the weights).

    Tokenizer(model_dir)
      .decode(ids)          text, special tokens skipped      (every process that streams text)
      .token_text(id)       one token, special ones included  (logprobs)
      .encode(text)         ids                               (text prompts: the router, LLM)
      .render_chat(msgs)    a chat template's text            (the HTTP API)

Chat templates are transformers' own (`AutoTokenizer`), loaded on first use (or by
`load(chat=True)`): its import costs ~4 s of CPU with torch's, and a worker, which
only decodes, or a router that serves no chat, never needs it.
Decoding uses the `tokenizers` library directly when the directory's tokenizer is
transformers' generic one (`tokenizer_class` TokenizersBackend or
PreTrainedTokenizerFast, with a tokenizer.json), where transformers' decode is
exactly the backend's: `tokenizer.json` as it is, plus the named special tokens of
tokenizer_config.json added as special ones (what transformers adds on load, so
`skip_special_tokens` skips the same ids), and its clean-up of spaces, which it
skips for BPE models, only when asked. Encoding does too when, besides, nothing in
tokenizer_config.json changes how transformers encodes (only the keys in
`PLAIN_KEYS`, each special token a plain string) and tokenizer.json asks for no
truncation or padding: transformers' encode is then the backend's. Any other
tokenizer decodes and encodes through transformers. tests/engine/test_tokenizer.py
holds the two to agreement.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
LIST_SPECIAL = ("extra_special_tokens", "additional_special_tokens")
# tokenizer_config.json keys that leave transformers' encode the backend's own (any other,
# e.g. add_bos_token, add_prefix_space or split_special_tokens, changes it)
PLAIN_KEYS = frozenset({"backend", "tokenizer_class", "clean_up_tokenization_spaces", "model_max_length",
                        "chat_template", "padding_side", "truncation_side", "model_input_names",
                        *NAMED_SPECIAL, *LIST_SPECIAL})


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = str(model_dir)
        self._lock = threading.Lock()
        self._hf: Any = None
        self._decoder, self._encoder = _direct_backend(Path(model_dir))
        if self._decoder is None:
            self._transformers()  # decoding needs it: load now, not on the first request

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._encoder is not None:
            return self._encoder.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._transformers().encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        if self._decoder is not None:
            return self._decoder.decode(list(token_ids), skip_special_tokens=True)
        return self._transformers().decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (what logprobs name it by)."""
        if self._decoder is not None:
            return self._decoder.decode([token_id], skip_special_tokens=False)
        return self._transformers().decode([token_id], skip_special_tokens=False)

    def load(self, chat: bool = False) -> None:
        """Load now what encoding (and with `chat`, rendering chat templates) needs: a
        server's, before its first request. Transformers' tokenizer only where it is used."""
        if chat or self._encoder is None:
            self._transformers()

    @property
    def chat_template(self) -> str | None:
        return getattr(self._transformers(), "chat_template", None) or None

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], template: str | None = None, add_generation_prompt: bool = True,
        continue_final_message: bool = False, kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """`messages` through the chat template (`template`, else the tokenizer's own), as
        text: transformers' own rendering. Raises ValueError when there is no template or
        it fails on these messages."""
        if template is None and self.chat_template is None:
            raise ValueError("messages: this model has no chat template (pass --chat-template FILE to the router); "
                             "use /v1/completions")
        try:
            return self._transformers().apply_chat_template(
                list(messages), chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **dict(kwargs or {}),
            )
        except ValueError:
            raise
        except Exception as e:  # a template's own error (jinja2 raising, a bad kwarg): the caller's input
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None

    def _transformers(self) -> Any:
        with self._lock:
            if self._hf is None:
                from transformers import AutoTokenizer  # heavy import: only where encoding is needed

                self._hf = AutoTokenizer.from_pretrained(self.model_dir)
            return self._hf


def _direct_backend(model_dir: Path) -> tuple[Any, Any]:
    """The `tokenizers` backend that decodes as transformers would (or None when this
    directory's tokenizer is not transformers' generic one), and the same backend again
    where it encodes as transformers would too (else None); see the module docstring."""
    path, config_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not path.is_file() or not config_path.is_file() or (model_dir / "special_tokens_map.json").exists():
        return None, None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None, None
    if config.get("tokenizer_class") not in GENERIC_CLASSES or "added_tokens_decoder" in config:
        return None, None
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(path))
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None, None  # transformers' clean-up applies: leave it to transformers
    special: list[str] = []
    for name in NAMED_SPECIAL:
        special += _token_contents(config.get(name))
    for name in LIST_SPECIAL:
        for value in _listed(config.get(name)):
            special += _token_contents(value)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    plain = (set(config) <= PLAIN_KEYS and backend.truncation is None and backend.padding is None
             and all(isinstance(config.get(name), (str, type(None))) for name in NAMED_SPECIAL)
             and all(isinstance(t, str) for name in LIST_SPECIAL for t in _listed(config.get(name))))
    return backend, backend if plain else None


def load_backend(model_dir: Path) -> Any:
    """A fresh `tokenizers` backend of a model directory (None: no tokenizer.json):
    transformers' own when the directory's tokenizer is its generic one, else
    tokenizer.json as it is (what grammar engines compile against; engine/structured/)."""
    backend, _ = _direct_backend(model_dir)
    if backend is not None:
        return backend
    if not (model_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer as Backend

    return Backend.from_file(str(model_dir / "tokenizer.json"))


def _listed(values: Any) -> list[Any]:
    """A list of special tokens as tokenizer_config.json gives it (a list, or a dict of them)."""
    if not values:
        return []
    return list(values.values()) if isinstance(values, dict) else list(values)


def _token_contents(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return [value["content"]]
    return []


def has_tokenizer(model_dir: str | Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    return any((Path(model_dir) / n).is_file() for n in names)

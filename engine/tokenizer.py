"""The model's own tokenizer (Hugging Face files next to the weights)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, only when text is used

        self._tok = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (what logprobs name it by)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        return getattr(self._tok, "chat_template", None) or None

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
            return self._tok.apply_chat_template(
                list(messages), chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **dict(kwargs or {}),
            )
        except ValueError:
            raise
        except Exception as e:  # a template's own error (jinja2 raising, a bad kwarg): the caller's input
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None


def has_tokenizer(model_dir: str | Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    return any((Path(model_dir) / n).is_file() for n in names)

"""The model's own tokenizer (Hugging Face files next to the weights)."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, only when text is used

        self._tok = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


def has_tokenizer(model_dir: str | Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    return any((Path(model_dir) / n).is_file() for n in names)

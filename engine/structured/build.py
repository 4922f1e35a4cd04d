"""An engine's structured-outputs manager, from its EngineConfig (None: the model has no
tokenizer.json to compile grammars against). Nothing of the grammar libraries is
imported or prepared here: the compiler builds its backend on first use, on its pool."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import STRUCTURED_OUTPUTS_BACKENDS, EngineConfig
from pdserve.engine.structured.backend import GrammarBackend, Vocabulary
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.manager import StructuredOutputsManager



def build_structured(
    config: EngineConfig, vocab_size: int, eos_token_ids: tuple[int, ...],
) -> StructuredOutputsManager | None:
    if not (Path(config.model) / "tokenizer.json").is_file():
        return None
    vocab = Vocabulary.from_model_dir(config.model, vocab_size, eos_token_ids)  # the tokenizers library: ms
    name = config.structured_outputs_backend

    def backend() -> GrammarBackend:
        return make_backend(name, vocab)

    compiler = GrammarCompiler(
        backend, name, vocab.fingerprint, config.structured_outputs_compile_timeout,
        config.structured_outputs_max_bytes, config.structured_outputs_max_depth,
    )
    return StructuredOutputsManager(compiler, vocab_size)


def make_backend(name: str, vocab: Vocabulary) -> GrammarBackend:
    """The named backend (its library imported now, and only then)."""
    if name == "xgrammar":
        from pdserve.engine.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(vocab)
    if name == "llguidance":
        from pdserve.engine.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(vocab)
    raise ValueError(f"structured_outputs_backend: unknown {name!r} (one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)})")

"""pdserve's inference core: a paged, prefix-caching engine for Llama-family models.

`LLM` (and with it torch) loads on first use of the name: launchers and the router
import this package's torch-free modules (config, sampling_params, validation, errors,
...) without paying for torch (the router's tokenizer still loads it: transformers'
AutoTokenizer imports torch when it is installed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")

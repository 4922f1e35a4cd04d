"""pdserve: disaggregated prefill/decode serving for large language models.

    from pdserve import LLM, SamplingParams

The repository's top-level folders (engine/, services/, kvtransfer/, ...) install as
subpackages of this one namespace (pyproject.toml maps `pdserve` onto the repository
root), so nothing but `pdserve` lands at the top of site-packages. The engine and torch
load on first use of its names, not on `import pdserve`: the router imports
`pdserve.services` without paying for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from pdserve.engine import LLM, CompletionOutput, RequestOutput, SamplingParams


def __getattr__(name: str) -> Any:
    if name in __all__:
        from pdserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")

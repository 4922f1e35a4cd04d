"""pdserve's inference core: a paged, prefix-caching engine for Llama-family models."""

from pdserve.engine.llm import LLM
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

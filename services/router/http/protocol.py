"""The request bodies of the OpenAI API, as vLLM accepts them, and what they mean here.

    CompletionRequest / ChatCompletionRequest / TokenizeRequest / DetokenizeRequest
        parse(Model, body bytes)  -> the model, or ApiError 400 naming the field
        sampling_of(body)         -> the engine's SamplingParams (the router's one sampling
                                     type), or ValueError naming the field

Unknown fields are ignored (clients send what other servers take); what pdserve
cannot do (`functions`, `suffix`) is a 400 naming the field (`unsupported`), never
silently dropped. Structured outputs (`response_format`, vLLM's `structured_outputs`
and `guided_*`) become one StructuredOutputs (structured.py); `logit_bias` (token id
strings -> [-100, 100]) goes to SamplingParams as it is, which checks it; tools
(`tools`, `tool_choice`, `parallel_tool_calls`) are checked in tools/request.py. JSON is
parsed by pydantic's own parser: NaN and infinities are refused, as are invalid
UTF-8 and nesting deeper than its limit.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.router.http.errors import ApiError, bad_request
from pdserve.services.router.http.structured import constraint_of

M = TypeVar("M", bound=BaseModel)
MAX_PROMPTS = 256  # prompts of one /v1/completions body (each is a request of its own)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampled(_Body):
    """The fields both generation endpoints share (OpenAI's and vLLM's extras)."""

    model: str | None = None
    n: int | None = None
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    # vLLM's extras, at the top level (as the openai client's `extra_body` sends them)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    # structured outputs (structured.py): OpenAI's, vLLM's and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None


TokenIds = list[int]


class CompletionRequest(_Sampled):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # assistant turns (checked in tools/messages.py)
    tool_call_id: str | None = None  # tool turns


class ChatCompletionRequest(_Sampled):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # tools, tool_choice: checked in tools/request.py
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a `prompt`, or chat `messages` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Any] | None = None  # with messages: rendered by the template, as chat does
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse(model: type[M], body: bytes) -> M:
    """`body` (JSON) as `model`; ApiError 400 naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = [str(part) for part in first.get("loc", ())]
        if first.get("type", "").startswith("json") or not loc:
            raise ApiError(400, f"body: not a JSON object of this endpoint's fields: {first.get('msg', '')}",
                           param="body") from None
        # Union members repeat the field with a type tag ("prompt.str", "prompt.list[int]"): keep the field path.
        param = ".".join(p for p in loc if not _is_type_tag(p))
        raise ApiError(400, f"{param}: {first.get('msg', 'invalid')}", param=param) from None


def _is_type_tag(part: str) -> bool:
    """A union member's tag in an error's location (`str`, `list[int]`, `literal['never']`),
    not a field name or a list index."""
    return part in ("str", "int", "bool", "float", "dict", "list") or "[" in part or part.startswith("function-")


def sampling_of(body: _Sampled, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The sampling of a body (`max_tokens` and `logprobs` as the endpoint reads them;
    a field left unset keeps the engine's default). Raises ApiError naming a field
    pdserve cannot honour, ValueError naming a value SamplingParams refuses (a
    malformed or doubled constraint: ConstraintRefused, naming the caller's field)."""
    unsupported(body)
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of", f"must equal n ({n}) or be unset: pdserve returns every sequence it samples")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "only with stream: true")
    fields = dict(
        max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=body.temperature, top_k=body.top_k,
        top_p=body.top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, seed=body.seed,
        stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        prompt_logprobs=body.prompt_logprobs, n=n, beam_width=n if body.use_beam_search else None,
        length_penalty=body.length_penalty, early_stopping=body.early_stopping,
        structured_outputs=constraint_of(body), logit_bias=body.logit_bias,
    )
    return SamplingParams(**{name: value for name, value in fields.items() if value is not None})


def unsupported(body: _Sampled) -> None:
    """A 400 for each field pdserve cannot do yet, naming it (never silently ignored)."""
    if isinstance(body, CompletionRequest) and body.suffix:
        raise bad_request("suffix", "not supported by pdserve")
    if isinstance(body, ChatCompletionRequest):
        if body.functions:
            raise bad_request("functions", "the legacy function calling is not supported by pdserve (send tools)")

"""The HTTP API's errors and request bodies, without a cluster (services/router/http/
errors.py and protocol.py): the project's statuses -> HTTP statuses, the one error
shape, the field an error names, Retry-After; JSON parsed strictly (NaN, infinities,
invalid UTF-8, non-JSON, deep nesting, wrong types: a 400 naming the field or the
body); a body's sampling options, and every field pdserve cannot honour refused by
name, never ignored; a chat prompt's bytes capped before it is tokenized (chat.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.http.chat import chat_prompt
from pdserve.services.router.http.errors import HTTP_STATUS, ApiError, api_error_of, bad_request, param_of
from pdserve.services.router.http.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse, sampling_of,
)

CHAT = [{"role": "user", "content": "hi"}]

# -- errors.py ----------------------------------------------------------------------------


def test_every_status_has_an_http_status_and_client_mistakes_are_4xx():
    assert set(HTTP_STATUS) == set(Status)
    want = {
        Status.INVALID_ARGUMENT: 400, Status.OUT_OF_RANGE: 400, Status.FAILED_PRECONDITION: 400,
        Status.UNAUTHENTICATED: 401, Status.PERMISSION_DENIED: 403, Status.NOT_FOUND: 404,
        Status.RESOURCE_EXHAUSTED: 429, Status.UNAVAILABLE: 503, Status.DEADLINE_EXCEEDED: 504,
        Status.INTERNAL: 500, Status.UNKNOWN: 500, Status.DATA_LOSS: 500,
    }
    assert {s: HTTP_STATUS[s] for s in want} == want
    # Only a fault of ours is a 500; everything a client can cause is below 500.
    assert {s for s, code in HTTP_STATUS.items() if code == 500} == {Status.INTERNAL, Status.UNKNOWN, Status.DATA_LOSS}


@pytest.mark.parametrize("status, kind, code", [
    (400, "invalid_request_error", "invalid_value"),
    (401, "authentication_error", "invalid_api_key"),
    (404, "not_found_error", "not_found"),
    (413, "invalid_request_error", "request_too_large"),
    (429, "rate_limit_error", "rate_limit_exceeded"),
    (503, "server_error", "unavailable"),
    (504, "server_error", "timeout"),
    (500, "server_error", "internal_error"),
])
def test_the_error_body_is_openais_shape(status, kind, code):
    body = ApiError(status, "what went wrong", param="field").body()
    assert body == {"error": {"message": "what went wrong", "type": kind, "param": "field", "code": code}}
    assert json.loads(json.dumps(body)) == body  # plain JSON, nothing else in it
    assert ApiError(status, "x", code="model_not_found").body()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("message, param", [
    ("max_tokens: must be >= 1, got 0", "max_tokens"),
    ("messages.0.role: must be one of ...", "messages.0.role"),
    ("stream_options.include_usage: Input should be a valid boolean", "stream_options.include_usage"),
    ("text: must be at most 10 bytes", "prompt"),  # the front end's names -> the OpenAI request's
    ("token_ids: token outside the vocabulary", "prompt"),
    ("beam_width: must be <= 8", "n"),
    ("no field named here", None),
    ("", None),
    (": nothing before the colon", None),
    ("two words: not a field", None),
])
def test_param_is_the_field_a_message_starts_with(message, param):
    assert param_of(message) == param


def test_a_front_end_error_maps_to_its_status_and_names_its_field_only_when_it_is_a_400():
    bad = api_error_of(ServeError(Status.INVALID_ARGUMENT, "top_p: must be in (0, 1], got 5.0"))
    assert (bad.status, bad.param, bad.message) == (400, "top_p", "top_p: must be in (0, 1], got 5.0")
    assert bad.headers() == {}
    # The chat endpoint's own names: its prompt is its messages.
    chat = api_error_of(ServeError(Status.INVALID_ARGUMENT, "token_ids: too long"), {"token_ids": "messages"})
    assert chat.param == "messages"
    gone = api_error_of(ServeError(Status.UNAVAILABLE, "router: shutting down"))
    assert (gone.status, gone.param) == (503, None)
    late = api_error_of(ServeError(Status.DEADLINE_EXCEEDED, "decode: deadline passed"))
    assert (late.status, late.body()["error"]["type"]) == (504, "server_error")


@pytest.mark.parametrize("retry_after_s, header", [(0.1, "1"), (1.0, "1"), (1.2, "2"), (30.0, "30"), (0.0, "1")])
def test_a_full_queue_is_a_429_with_retry_after_in_whole_seconds_at_least_one(retry_after_s, header):
    error = api_error_of(ServeError(Status.RESOURCE_EXHAUSTED, "router: full", retry_after_s=retry_after_s))
    assert error.status == 429 and error.param is None
    assert error.headers() == {"Retry-After": header}


def test_bad_request_names_its_field():
    error = bad_request("best_of", "must equal n")
    assert (error.status, error.param, error.message) == (400, "best_of", "best_of: must equal n")


# -- protocol.py: parse -------------------------------------------------------------------


def refused(model, body: bytes | str) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(model, body.encode() if isinstance(body, str) else body)
    assert info.value.status == 400
    assert info.value.message.startswith(f"{info.value.param}: "), info.value.message
    return info.value


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 2.5}', "max_tokens"),
    ('{"prompt": "x", "n": [1]}', "n"),
    ('{"prompt": 5}', "prompt"),
    ('{"prompt": [1, "a"]}', "prompt"),
    ('{"prompt": [[1], "a"]}', "prompt"),
    ('{"prompt": {"text": "x"}}', "prompt"),
    ('{"max_tokens": 4}', "prompt"),  # missing
    ('{"prompt": "x", "stop": [1]}', "stop"),
    ('{"prompt": "x", "temperature": "hot"}', "temperature"),
    ('{"prompt": "x", "logprobs": "maybe"}', "logprobs"),
    ('{"prompt": "x", "stream_options": {"include_usage": "maybe"}}', "stream_options.include_usage"),
    ('{"prompt": "x", "stream_options": 1}', "stream_options"),
    ('{"prompt": "x", "early_stopping": "sometimes"}', "early_stopping"),
    ('{"prompt": "x", "stop_token_ids": "1,2"}', "stop_token_ids"),
    ('{"prompt": "x", "logit_bias": {"1": "a"}}', "logit_bias.1"),
    ('{"prompt": "x", "seed": 1e308}', "seed"),
])
def test_a_wrong_type_is_a_400_naming_the_field(body, param):
    assert refused(CompletionRequest, body).param == param


@pytest.mark.parametrize("body, param", [
    ('{"messages": []}', "messages"),
    ('{"messages": "hello"}', "messages"),
    ('{"messages": [{"content": "x"}]}', "messages.0.role"),
    ('{"messages": [{"role": 1, "content": "x"}]}', "messages.0.role"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"text": "y"}]}]}',
     "messages.1.content"),
    ('{"messages": [{"role": "user", "content": "x"}], "logprobs": "maybe"}', "logprobs"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}', "tools"),
])
def test_a_wrong_chat_field_is_a_400_naming_it(body, param):
    assert refused(ChatCompletionRequest, body).param == param


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "length_penalty"])
def test_nan_and_infinities_are_refused_naming_the_field(field, literal):
    error = refused(CompletionRequest, f'{{"prompt": "x", "{field}": {literal}}}')
    assert error.param == field and "finite" in error.message


@pytest.mark.parametrize("body", [
    b"not json", b"", b"   ", b"{", b'{"prompt": "x",}', b"{'prompt': 'x'}",
    b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xc3"}', b"\xef\xbb\xbf\xff",
    b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "x", "chat_template_kwargs": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_001,
    b"[]", b'"prompt"', b"null", b"5", b"true", b'[{"prompt": "x"}]',
])
def test_what_is_not_a_json_object_is_a_400_naming_the_body(body):
    model = CompletionRequest if b"chat_template_kwargs" not in body else ChatCompletionRequest
    error = refused(model, body)
    assert error.param == "body" and error.message.startswith("body: not a JSON object")


def test_a_body_of_the_other_endpoints_parses_or_names_its_field():
    assert parse(TokenizeRequest, b'{"prompt": "x"}').prompt == "x"
    assert refused(TokenizeRequest, '{"prompt": 5}').param == "prompt"
    assert parse(DetokenizeRequest, b'{"tokens": [1, 2]}').tokens == [1, 2]
    assert refused(DetokenizeRequest, '{"tokens": "abc"}').param == "tokens"
    assert refused(DetokenizeRequest, '{}').param == "tokens"


def test_unknown_fields_are_ignored_and_the_prompt_forms_parse():
    body = parse(CompletionRequest, b'{"prompt": "x", "not_a_field": {"deep": [1, 2]}, "service_tier": "auto"}')
    assert body.prompt == "x" and body.max_tokens == 16  # OpenAI's default for completions
    for prompt in ("x", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert parse(CompletionRequest, json.dumps({"prompt": prompt}).encode()).prompt == prompt
    assert parse(CompletionRequest, b'{"prompt": "x", "max_tokens": null}').max_tokens is None


# -- protocol.py: sampling_of -------------------------------------------------------------


def completion(**fields) -> CompletionRequest:
    return parse(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())


def chat(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, json.dumps({"messages": CHAT, **fields}).encode())


def sampling(body, max_tokens: int | None = 16, logprobs: int | None = None) -> SamplingParams:
    return sampling_of(body, max_tokens, logprobs)


def refused_sampling(body) -> ApiError:
    with pytest.raises(ApiError) as info:
        sampling(body)
    assert info.value.status == 400 and info.value.message.startswith(f"{info.value.param}: ")
    return info.value


def test_the_fields_map_onto_the_front_ends_sampling_options():
    body = completion(n=3, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, stop="\n", stop_token_ids=[3],
                      presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, min_tokens=2,
                      ignore_eos=True, prompt_logprobs=2)
    assert sampling(body, 9, 4) == SamplingParams(
        max_tokens=9, min_tokens=2, temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=7, stop=("\n",), stop_token_ids=(3,), ignore_eos=True,
        logprobs=4, prompt_logprobs=2, n=3,
    )
    assert sampling(completion(stop=["a", "b"])).stop == ("a", "b")
    assert sampling(completion()).n == 1 and sampling(completion()).stop == ()


def test_best_of_must_equal_n():
    assert sampling(completion(n=2, best_of=2)).n == 2
    assert sampling(completion(best_of=1)).n == 1
    for fields in (dict(best_of=3), dict(n=2, best_of=4), dict(n=3, best_of=1)):
        assert refused_sampling(completion(**fields)).param == "best_of"


def test_stream_options_only_with_stream():
    options = {"include_usage": True}
    assert refused_sampling(completion(stream_options=options)).param == "stream_options"
    assert refused_sampling(chat(stream=False, stream_options=options)).param == "stream_options"
    sampling(completion(stream=True, stream_options=options))
    sampling(chat(stream=True, stream_options=options))


def test_beam_search_and_early_stopping():
    beams = sampling(completion(use_beam_search=True, n=3, length_penalty=0.5, early_stopping=True))
    assert (beams.beam_width, beams.n, beams.length_penalty, beams.early_stopping) == (3, 3, 0.5, True)
    assert sampling(completion(use_beam_search=True)).beam_width == 1
    assert sampling(completion(n=3)).beam_width == 1  # sampling, not beams
    assert not sampling(completion(n=3)).use_beam_search
    assert sampling(completion(use_beam_search=True, n=2, early_stopping=False)).early_stopping is False
    assert sampling(completion(use_beam_search=True, n=2, early_stopping="never")).early_stopping == "never"
    assert sampling(completion(use_beam_search=True, n=2)).early_stopping is False  # the engine's default


@pytest.mark.parametrize("fields, param", [
    (dict(functions=[{"name": "f"}]), "functions"),
])
def test_what_pdserve_cannot_do_is_a_400_naming_the_field_on_chat(fields, param):
    assert refused_sampling(chat(**fields)).param == param


def test_what_pdserve_cannot_do_is_a_400_naming_the_field_on_completions():
    assert refused_sampling(completion(suffix="\n}")).param == "suffix"


def test_the_harmless_forms_of_those_fields_are_taken():
    for fields in (dict(tools=[]), dict(tool_choice="none"), dict(response_format={"type": "text"}),
                   dict(logit_bias={}), dict(functions=[]), dict(tools=None, tool_choice=None)):
        sampling(chat(**fields))
    sampling(completion(suffix=""))
    sampling(completion(logit_bias=None))


# -- chat.py: a chat prompt's bytes are capped before it is tokenized -------------------------


def test_a_rendered_chat_prompt_over_max_prompt_bytes_is_refused_before_it_is_tokenized():
    tokenizer = Tokenizer(DEFAULT_MODEL)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    messages = parse(ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": "é" * 600}]}).encode()
                     ).messages
    rendered = len(b"user: ") + 1200 + 1
    assert chat_prompt(tokenizer, template, messages, False, False, None, False, max_prompt_bytes=rendered)
    with pytest.raises(ApiError) as info:
        chat_prompt(tokenizer, template, messages, False, False, None, False, max_prompt_bytes=rendered - 1)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert f"got {rendered}" in info.value.message


# -- app.py: a body is read within a deadline ----------------------------------------------------


def test_a_body_trickled_past_its_deadline_is_a_408_and_a_whole_one_is_read():
    import asyncio
    import types

    from starlette.requests import Request as StarletteRequest

    from pdserve.services.router.http.app import HttpApi

    def request(parts: list[bytes], stall: bool) -> StarletteRequest:
        async def receive() -> dict:
            if parts:
                return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts) or stall}
            await asyncio.sleep(3600)  # the client sends nothing more
            return {"type": "http.disconnect"}

        return StarletteRequest({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)

    api = types.SimpleNamespace(max_body_bytes=1024, body_timeout=0.2)
    assert asyncio.run(HttpApi._body(api, request([b'{"a":', b"1}"], stall=False))) == b'{"a":1}'
    with pytest.raises(ApiError) as info:
        asyncio.run(HttpApi._body(api, request([b'{"a":'], stall=True)))
    assert (info.value.status, info.value.param) == (408, "body")
    assert info.value.body()["error"]["code"] == "request_timeout"

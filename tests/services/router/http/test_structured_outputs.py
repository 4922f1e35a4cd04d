"""Structured outputs and logit_bias end to end: the real `openai` client (and the
project's gRPC Client) against `pdserve up` with the embedded model, every prompt's
KV crossing from a prefill worker (the prefill worker samples the first token under
the constraint, the decode worker goes on from it).

    `pdserve up --http-port 0 --prefill 1 --decode 1 --local-prefill-threshold 0`
        openai.OpenAI(max_retries=0)          response_format json_schema (validated
                                              with jsonschema), chat.completions.parse
                                              with a pydantic model, json_object,
                                              structured_outputs / guided_* extras,
                                              logit_bias, streamed; a malformed, huge or
                                              deep schema, two constraints, a bias outside
                                              the vocabulary, a regex the backend refuses
                                              -> openai.BadRequestError naming the field
        services/router/client.py Client      the same constraints over gRPC
        the router's /metrics                 requests by kind, refusals by reason

Every constrained output must parse and validate; every request here is short
(greedy unless said, a few dozen tokens at most). One cluster for the module.
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest

from cluster_helpers import metric
from http_checks import HttpUp
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=30)

MODEL = "pdserve-tiny-code"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 96
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


class Answer(pydantic.BaseModel):
    verdict: bool
    score: int = pydantic.Field(ge=0, le=9)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    up = HttpUp(["--prefill", "1", "--decode", "1", "--local-prefill-threshold", "0", "--num-blocks", "256",
                 "--max-n", "4", "--log-level", "WARNING"], tmp_path_factory.mktemp("structured") / "up.log")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    with openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def validated(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def router_metric(up: HttpUp, name: str, **labels: str) -> float:
    return sum(metric(up.metrics_url(), f"pdserve:{name}_total", role="router", **labels).values())


# -- needs the engine's constrained decoding ------------------------------------------------


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7, n=2)],
                         ids=["greedy", "seeded-n2"])
def test_response_format_json_schema_validates(client, sampling):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                           response_format=schema_format(PERSON), **sampling)
    assert len(reply.choices) == sampling.get("n", 1)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        validated(choice.message.content, PERSON)


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Is 2 > 1?"}],
                                          response_format=Answer, max_tokens=MAX_TOKENS, temperature=0.0)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Answer) and 0 <= parsed.score <= 9


def test_instructor_gets_a_validated_model(up):
    """instructor (its JSON-schema mode: response_format json_schema) over the openai client."""
    import instructor

    with openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=120) as raw:
        patched = instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
        answer = patched.chat.completions.create(model=MODEL, response_model=Answer, max_retries=1,
                                                 messages=[{"role": "user", "content": "Is 2 > 1?"}],
                                                 max_tokens=MAX_TOKENS, temperature=0.0)
    assert isinstance(answer, Answer) and 0 <= answer.score <= 9


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(up, method):
    """LangChain's with_structured_output: by response_format (json_schema) and by a
    forced tool call (function_calling: tools + a named tool_choice), both parsed into
    the pydantic model."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=up.url, api_key="unused", model=MODEL, max_retries=0, temperature=0,
                     max_tokens=MAX_TOKENS)
    answer = llm.with_structured_output(Answer, method=method).invoke("Is 2 > 1?")
    assert isinstance(answer, Answer) and 0 <= answer.score <= 9


def test_json_object_is_a_json_object(client):
    # Any JSON object may be endless (a string that never closes): this prompt's greedy
    # object, on the embedded model, is short.
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A stack of items."}],
                                           max_tokens=MAX_TOKENS, temperature=0.0,
                                           response_format={"type": "json_object"})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def test_a_streamed_json_schema_validates(client):
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
                                            response_format=schema_format(PERSON), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    validated(text, PERSON)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"guided_json": PERSON}, lambda t: validated(t, PERSON)),
], ids=["choice", "guided_choice", "regex", "guided_json"])
def test_vllms_extras_on_completions(client, extra, check):
    reply = client.completions.create(model=MODEL, prompt="def color():\n    return ", max_tokens=MAX_TOKENS,
                                      temperature=0.0, extra_body=extra)
    assert reply.choices[0].finish_reason == "stop" and check(reply.choices[0].text), reply.choices[0].text


def test_logit_bias_steers_and_bans_tokens(client, up):
    prompt = "def add(a, b):\n"
    with Client(up.address, timeout=120) as grpc_client:
        def greedy(**sampling) -> list[int]:
            (seq,) = collect(grpc_client.generate(prompt, model=MODEL, max_tokens=3, temperature=0.0,
                                                  ignore_eos=True, **sampling)).values()
            return list(seq.token_ids)

        first = greedy()[0]
        assert greedy(logit_bias={first: -100})[0] != first
        (x,) = httpx.post(f"{up.root}/tokenize", json={"prompt": "x", "add_special_tokens": False}, timeout=30).json()[
            "tokens"][-1:]
        assert greedy(logit_bias={str(x): 100}) == [x, x, x]
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0,
                                       logit_bias={str(x): 100}, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 3
    assert forced.choices[0].text == httpx.post(f"{up.root}/detokenize", json={"tokens": [x, x, x]},
                                                timeout=30).json()["prompt"]


def test_grpc_client_constraints(up):
    with Client(up.address, timeout=120) as grpc_client:
        (seq,) = collect(grpc_client.generate("def color():\n    return ", model=MODEL, max_tokens=MAX_TOKENS,
                                              temperature=0.0, structured_outputs={"choice": ["red", "blue"]})).values()
        assert seq.finish_reason == "stop" and seq.text in ("red", "blue")
        (seq,) = collect(grpc_client.generate("A person: ", model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0,
                                              structured_outputs={"json": PERSON})).values()
        validated(seq.text, PERSON)
        with pytest.raises(grpc.RpcError) as info:  # the backend's refusal: final, with the reason
            collect(grpc_client.generate("x", model=MODEL, max_tokens=4, structured_outputs={"regex": "(unclosed"}))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("structured_outputs: refused by the grammar backend")
        assert "FAILURE_KIND_INVALID_CONSTRAINT" in info.value.details()


def test_a_regex_the_backend_refuses_is_a_400_naming_the_callers_field(client, up):
    before = router_metric(up, "router_structured_outputs_refusals", reason="invalid")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(unclosed"})
    error = info.value.response.json()["error"]
    assert error["param"] == "guided_regex" and error["message"].startswith("guided_regex: ")
    assert router_metric(up, "router_structured_outputs_refusals", reason="invalid") == before + 1


def test_requests_are_counted_by_kind(client, up):
    before = router_metric(up, "router_structured_outputs_requests", kind="regex")
    client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0.0,
                              extra_body={"structured_outputs": {"regex": "[ab]{2}"}})
    assert router_metric(up, "router_structured_outputs_requests", kind="regex") == before + 1


# -- the router alone (passes without the engine's side) ---------------------------------------


def test_a_malformed_schema_is_a_bad_request_naming_the_field(client, up):
    before = router_metric(up, "router_structured_outputs_refusals", reason="invalid_schema")
    bad = {"type": "object", "properties": {"age": {"type": "integr"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, response_format=schema_format(bad))
    error = info.value.response.json()["error"]
    assert error["param"] == "response_format.json_schema" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("response_format.json_schema: not a valid JSON schema") and "integr" in \
        error["message"]
    with pytest.raises(openai.BadRequestError) as info:  # streaming: refused before any event
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                       extra_body={"guided_json": bad})
    assert info.value.response.json()["error"]["param"] == "guided_json"
    assert router_metric(up, "router_structured_outputs_refusals", reason="invalid_schema") == before + 2


def test_a_huge_or_deep_schema_is_refused_before_dispatch(client, up):
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}  # > 64 KiB
    deep: dict = {"type": "integer"}
    for _ in range(20):  # 41 brackets deep, more than --structured-outputs-max-depth 32
        deep = {"type": "object", "properties": {"a": deep}}
    before = {r: router_metric(up, "router_structured_outputs_refusals", reason=r) for r in ("too_large", "too_deep")}
    for schema, reason in ((huge, "too_large"), (deep, "too_deep")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                           response_format=schema_format(schema))
        error = info.value.response.json()["error"]
        assert error["param"] == "response_format.json_schema", error
        assert router_metric(up, "router_structured_outputs_refusals", reason=reason) == before[reason] + 1


def test_two_constraints_are_a_bad_request_naming_both(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    error = info.value.response.json()["error"]
    assert error["param"] == "response_format" and "guided_regex" in error["message"]


def test_a_logit_bias_outside_the_vocabulary_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, logit_bias={"999999": 5})
    assert info.value.response.json()["error"]["param"] == "logit_bias"


def test_grpc_a_malformed_schema_is_invalid_argument(up):
    with Client(up.address, timeout=60) as grpc_client:
        with pytest.raises(grpc.RpcError) as info:
            collect(grpc_client.generate("x", model=MODEL, max_tokens=4,
                                         structured_outputs={"json": {"type": "object", "required": "age"}}))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("structured_outputs.json_schema: not a valid JSON schema")

"""Tool calling through the OpenAI HTTP API, driven by the real clients (`openai`,
langchain-openai) against `pdserve up` on the embedded model (its own chat template,
which renders tools; the router's default `--tool-call-parser hermes`).

    tool_choice auto      the model's text parsed for <tool_call> blocks. The embedded
                          model does not call tools by itself, so the text is made to hold
                          one: an assistant turn continued (continue_final_message) and
                          echoed, which the router parses with what the model adds
    tool turns            an assistant turn's tool_calls and a tool result rendered by the
                          template (prompt_tokens equal the template's, by transformers)
    named / required      decoding constrained to a valid call (a StructuredOutputs JSON
                          schema): arguments validated with jsonschema; LangChain's
                          bind_tools round trip (the engine's constrained decoding).

One decode worker (it prefills itself), one cluster for the module.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from cluster_helpers import UpProcess
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.cluster(seconds=20)

MODEL = "pdserve-tiny-code"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                               "unit": {"type": "string", "enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                            "parameters": PARAMETERS}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time.",
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {"get_weather": PARAMETERS, "now": CLOCK["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    up = UpProcess(["--prefill", "0", "--decode", "1", "--http-port", "0", "--num-blocks", "128"],
                   tmp_path_factory.mktemp("up") / "up.log")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    with openai.OpenAI(base_url=up.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def valid_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its arguments validated against its tool's schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


# -- without the engine's constraints ----------------------------------------------------


def test_auto_parses_a_call_from_the_text_streamed_or_not(client):
    """An assistant turn holding a call, continued by the model and echoed: the router
    parses the answer's text (the call, and what the model added as content)."""
    messages = [*ASK, {"role": "assistant", "content": "Let me look.\n" + CALL}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
                                       extra_body=extra)
    (choice,) = r.choices
    assert valid_calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert choice.message.content.startswith("Let me look.\n")  # the text before, then the model's own
    assert choice.finish_reason in ("tool_calls", "length")
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4,
                                                temperature=0, extra_body=extra, stream=True):
        (delta_choice,) = chunk.choices
        content += delta_choice.delta.content or ""
        for call in delta_choice.delta.tool_calls or ():
            if call.id is not None:  # a call begins: its id, type and name come first
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls[call.index] = [call.id, call.function.name, call.function.arguments or ""]
            else:
                calls[call.index][2] += call.function.arguments
        finish = delta_choice.finish_reason or finish
    assert content == choice.message.content and finish == choice.finish_reason
    assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]


def test_tool_choice_none_leaves_the_text_alone(client):
    messages = [*ASK, {"role": "assistant", "content": CALL}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2,
                                       extra_body={"echo": True, "continue_final_message": True,
                                                   "add_generation_prompt": False})
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.startswith(CALL)


def test_tools_and_tool_turns_go_through_the_template(up, client):
    """The prompt is the template's rendering of the tools and the tool turns (its
    token count equals transformers' own rendering, tokenized, and /tokenize's)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=2, temperature=0)
    tokenizer = Tokenizer(DEFAULT_MODEL)
    as_template = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]}, messages[2]]
    text = tokenizer.render_chat(as_template, kwargs={"tools": TOOLS})
    assert "def get_weather(city: str, unit: str):" in text and "-3 C, snow" in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    tokenized = httpx.post(up.openai_url.removesuffix("/v1") + "/tokenize",
                           json={"messages": messages, "tools": TOOLS}, timeout=30)
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == ids


def test_bad_tools_are_a_400_naming_the_field(client):
    for fields, param in ((dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}),
                           "tool_choice.function.name"),
                          (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name"),
                          (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]),
                           "tools.0.function.parameters"),
                          (dict(tool_choice="required"), "tool_choice")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **fields)
        assert info.value.body["param"] == param and info.value.body["message"].startswith(param + ":")


def test_langchain_sends_a_tool_round_trip_back(up):
    """LangChain's bind_tools with a conversation that holds its own AIMessage tool call
    and the ToolMessage answering it: the router takes it and answers."""
    llm = ChatOpenAI(base_url=up.openai_url, api_key="unused", model=MODEL, max_retries=0, temperature=0,
                     max_tokens=4)
    bound = llm.bind_tools(TOOLS)
    history = [HumanMessage(ASK[0]["content"]),
               AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Lima", "unit": "c"},
                                          "id": "call_9"}]),
               ToolMessage("22 C, sunny", tool_call_id="call_9")]
    answer = bound.invoke(history)
    assert isinstance(answer, AIMessage) and answer.response_metadata["finish_reason"] in ("stop", "length",
                                                                                           "tool_calls")


# -- with the engine's constraints --------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_gives_its_valid_call(client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=64, temperature=1.0, seed=3, n=2)
        for c in r.choices:
            assert [name for name, _ in valid_calls(c.message.tool_calls)] == ["get_weather"]
            assert c.finish_reason == "stop" and c.message.content is None
        return
    name, arguments = None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=64, temperature=0, stream=True):
        for call in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            assert call.index == 0
            name = call.function.name or name
            arguments += call.function.arguments or ""
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMETERS)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_at_least_one_valid_call(client, parallel):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=parallel, max_tokens=96, temperature=0)
    (choice,) = r.choices
    calls = valid_calls(choice.message.tool_calls)
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    # With parallel calls the list has no upper bound (as OpenAI's and vLLM's): the tiny
    # greedy model may go on calling until max_tokens cuts it ("length"), and every call
    # completed before the cut is still returned, valid.
    assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length")


def test_langchain_bind_tools_round_trip(up):
    """The model's (forced) call, the tool's result sent back as a ToolMessage, a final answer."""
    llm = ChatOpenAI(base_url=up.openai_url, api_key="unused", model=MODEL, max_retries=0, temperature=0,
                     max_tokens=64)
    forced = llm.bind_tools(TOOLS, tool_choice="get_weather")
    history = [HumanMessage(ASK[0]["content"])]
    ai = forced.invoke(history)
    assert not ai.invalid_tool_calls and [c["name"] for c in ai.tool_calls] == ["get_weather"]
    jsonschema.validate(ai.tool_calls[0]["args"], PARAMETERS)
    history += [ai, ToolMessage("22 C, sunny", tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools(TOOLS, tool_choice="none").invoke(history)
    assert isinstance(final, AIMessage) and not final.tool_calls and isinstance(final.content, str)

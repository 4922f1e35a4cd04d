"""Tool calling's request side (services/router/http/tools/): tools, tool_choice and
tool turns checked (400s naming the field), the constraint tool_choice puts on decoding
(validated with jsonschema against real calls), and the embedded model's chat template
rendering tools and tool turns through transformers (without tools: byte-identical to
the template before tools)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster_helpers import REPO
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.router.http.chat import chat_prompt
from pdserve.services.router.http.errors import ApiError
from pdserve.services.router.http.protocol import ChatCompletionRequest, Message, parse
from pdserve.services.router.http.tools import output
from pdserve.services.router.http.tools.constraint import constraint_of, required_schema, with_tool_constraint
from pdserve.services.router.http.tools.registry import parser_factory
from pdserve.services.router.http.tools.request import tool_request

MODEL = REPO / "models" / "pdserve-tiny-code"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
# The embedded template before tools (commit 58e42db), for the byte-identity check.
BEFORE = """{{- bos_token -}}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{- message['content'] + '\\n\\n' -}}
    {%- else -%}
        {{- '\"\"\"' + message['content'] | replace('\"\"\"', "'''") + '\"\"\"\\n\\n' -}}
    {%- endif -%}
{%- endfor -%}
"""


def refused(tools, tool_choice=None, parallel=None) -> ApiError:
    with pytest.raises(ApiError) as info:
        tool_request(tools, tool_choice, parallel)
    error = info.value
    assert error.status == 400 and error.message.startswith(f"{error.param}: "), error.message
    return error


# -- request.py -------------------------------------------------------------------------


def test_tools_and_choices_are_read():
    tools = tool_request([WEATHER, CLOCK], None, None)
    assert [t.name for t in tools.tools] == ["get_weather", "now"] and tools.choice == "auto" and tools.parallel
    assert tools.tools[1].schema == {"type": "object", "properties": {}}
    assert tools.template_tools() == [WEATHER, CLOCK]
    named = tool_request([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}}, False)
    assert (named.choice, named.named.name, named.parallel) == ("named", "now", False)
    assert tool_request([WEATHER], "required", None).constrained
    assert not tool_request([WEATHER], "none", None).parses_text
    assert tool_request(None, None, None) is None and tool_request([], "none", None) is None


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "retrieval"}], None, "tools.0.type"),
    (["get_weather"], None, "tools.0"),
    ([{"type": "function"}], None, "tools.0.function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools.0.function.name"),
    ([WEATHER, CLOCK, WEATHER], None, "tools.2.function.name"),  # a duplicate
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minLength": -1}}}}}],
     None, "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools.0.function.description"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice.function.name"),
    ([WEATHER], {"type": "function"}, "tool_choice.function.name"),
    ([WEATHER], {"type": "tool", "name": "get_weather"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "f"}}, "tool_choice.function.name"),
])
def test_bad_tools_are_a_400_naming_the_field(tools, choice, param):
    assert refused(tools, choice).param == param


def test_a_deep_schema_is_refused_without_recursing():
    deep = {"type": "object"}
    for _ in range(2000):
        deep = {"type": "object", "properties": {"a": deep}}
    error = refused([{"type": "function", "function": {"name": "f", "parameters": deep}}])
    assert error.param == "tools.0.function.parameters"


def test_the_request_body_takes_tools_and_tool_turns():
    body = parse(ChatCompletionRequest, json.dumps({
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}],
        "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False}).encode())
    assert body.parallel_tool_calls is False and body.messages[2].tool_call_id == "call_1"


# -- constraint.py ----------------------------------------------------------------------


CALLS_OK = [[{"name": "get_weather", "parameters": {"city": "Paris"}}],
            [{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]]
CALLS_BAD = [[], [{"name": "get_time", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
             [{"name": "get_weather", "parameters": {"city": "Paris", "wind": 1}}], {"name": "now", "parameters": {}},
             [{"name": "now"}]]


def test_required_is_a_list_of_calls_of_the_tools():
    tools = tool_request([WEATHER, CLOCK], "required", None)
    constraint = constraint_of(tools)
    assert constraint.kind is ConstraintKind.JSON_SCHEMA
    schema = json.loads(constraint.spec)
    assert schema == required_schema(tools.tools, True)
    jsonschema.Draft202012Validator.check_schema(schema)
    for calls in CALLS_OK:
        jsonschema.validate(calls, schema)
    for calls in CALLS_BAD:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    one = json.loads(constraint_of(tool_request([WEATHER, CLOCK], "required", False)).spec)
    jsonschema.validate(CALLS_OK[0], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(CALLS_OK[1], one)


def test_both_grammar_backends_take_the_constraints():
    """The schemas compile in xgrammar (which accepts exactly the valid calls, checked by
    its own test helper) and in llguidance (validated without a tokenizer): what the
    engine's backends are given."""
    import llguidance
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    for parallel in (True, False):
        constraint = constraint_of(tool_request([WEATHER, CLOCK], "required", parallel))
        grammar = xgrammar.Grammar.from_json_schema(constraint.spec)
        for calls in CALLS_OK[:1] + (CALLS_OK[1:] if parallel else []):
            assert accepts(grammar, json.dumps(calls)), calls
        for calls in CALLS_BAD + ([] if parallel else CALLS_OK[1:]):
            assert not accepts(grammar, json.dumps(calls)), calls
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(constraint.spec)) \
            == ""
    named = constraint_of(tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None))
    grammar = xgrammar.Grammar.from_json_schema(named.spec)
    assert accepts(grammar, '{"city": "Paris", "unit": "c"}') and not accepts(grammar, '{"unit": "c"}')


def test_a_named_function_is_its_parameters():
    named = tool_request([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert constraint_of(named) == StructuredOutputs.json_schema(WEATHER["function"]["parameters"])
    no_parameters = tool_request([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}}, None)
    assert json.loads(constraint_of(no_parameters).spec) == {"type": "object", "properties": {}}


def test_auto_and_none_leave_sampling_free_and_the_rest_constrain_it():
    base = SamplingParams(max_tokens=8)
    assert with_tool_constraint(base, tool_request([WEATHER], "auto", None)) is base
    assert with_tool_constraint(base, tool_request([WEATHER], "none", None)) is base
    assert with_tool_constraint(base, None) is base
    forced = with_tool_constraint(base, tool_request([WEATHER], "required", None))
    assert forced.structured_outputs == constraint_of(tool_request([WEATHER], "required", None))
    both = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(ConstraintKind.JSON_OBJECT))
    with pytest.raises(ApiError) as info:
        with_tool_constraint(both, tool_request([WEATHER], "required", None))
    assert info.value.param == "tool_choice"


def test_constrained_outputs_become_calls():
    hermes = parser_factory("hermes")
    named = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    content, calls = output.whole(named, hermes, '{"city": "Paris"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert output.finish_reason(named, "stop", True) == "stop"  # as OpenAI's forced calls
    required = tool_request([WEATHER, CLOCK], "required", None)
    content, calls = output.whole(required, hermes, json.dumps(CALLS_OK[1]))
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("now", {}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert output.finish_reason(required, "stop", True) == "tool_calls"
    assert output.finish_reason(required, "length", False) == "length"
    content, calls = output.whole(required, hermes, '[{"name": "now", "parameters": {}}, {"name": "get_w')  # cut off
    assert content == '{"name": "get_w' and [c["function"]["name"] for c in calls] == ["now"]
    auto = tool_request([WEATHER], "auto", None)
    assert output.whole(auto, hermes, "no call") == ("no call", [])


# -- chat.py + the embedded template ----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(MODEL)


def _render(tokenizer, messages, tools=None, template=None, add_generation_prompt=False) -> str:
    ids = chat_prompt(tokenizer, template, [Message(**m) for m in messages], add_generation_prompt, False, None,
                      False, tools=tools)
    return tokenizer.decode(ids)


CONVERSATIONS = [
    [{"role": "user", "content": "Add two numbers."}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": 'A """quoted""" ask.'},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}, {"role": "user", "content": "more"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_without_tools_the_template_renders_as_before(tokenizer, messages):
    hf = tokenizer._transformers()
    plain = [{**m, "role": "system" if m["role"] == "developer" else m["role"],
              "content": m["content"] if isinstance(m["content"], str) else "x"} for m in messages]
    for generation in (True, False):
        assert hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation) == \
            hf.apply_chat_template(plain, chat_template=BEFORE, tokenize=False, add_generation_prompt=generation)


def test_tools_and_tool_turns_render_through_transformers(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    text = _render(tokenizer, messages, [WEATHER, CLOCK])
    hf = tokenizer._transformers()
    expected = hf.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}],
        tools=[WEATHER, CLOCK], tokenize=False)
    assert text == expected.removeprefix(hf.bos_token)  # decode drops the special BOS
    assert 'def get_weather(city: str, unit: str = None):\n    """The weather of a city.' in text
    assert "def now():" in text
    assert '"""Weather in Paris?"""\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' \
           '</tool_call>\n\n"""<tool_response>\n20 C\n</tool_response>"""\n\n' in text
    # what the template writes for a call, the hermes parser reads back
    call = text[text.index("<tool_call>{\"name\": \"get"):text.rindex("</tool_call>") + len("</tool_call>")]
    content, calls = output.whole(tool_request([WEATHER], "auto", None), parser_factory("hermes"), call)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "20 C"}, "messages.0.tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "messages.0.tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
     "messages.0.tool_calls.0.function.name"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_tool_turns_are_a_400_naming_the_field(tokenizer, message, param):
    with pytest.raises(ApiError) as info:
        _render(tokenizer, [message])
    assert info.value.param == param

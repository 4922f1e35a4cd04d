"""The tool-call parsers (services/router/http/tools/): whole texts and the same texts
streamed split at every character boundary (and char by char) give the same content and
calls; malformed calls stay text; OpenAI's delta shapes."""

from __future__ import annotations

import json

import pytest

from pdserve.services.router.http.tools.constraint import NamedCall, RequiredCalls
from pdserve.services.router.http.tools.hermes import HermesParser
from pdserve.services.router.http.tools.llama3_json import Llama3JsonParser
from pdserve.services.router.http.tools.output import ToolDeltas, message
from pdserve.services.router.http.tools.parsers import merged, parse_whole
from pdserve.services.router.http.tools.registry import parser_factory

WEATHER = {"city": "Paris", "note": "a } and a \" and </tool_call>? no: {\"x\": [1]}"}

HERMES = [  # (text, content, [(name, arguments)])
    ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}\n</tool_call>',
     "Let me check.", [("get_weather", WEATHER)]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"n": 1}}'
     '</tool_call>', "\n", [("a", {}), ("b", {"n": 1})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"n\\": 2}"}</tool_call>', "", [("a", {"n": 2})]),
    ("no calls here, just < and <tool and <tool_cal", "no calls here, just < and <tool and <tool_cal", []),
    ('<tool_call>{"name": "a", "arguments": {"n": }</tool_call> after', '<tool_call>{"name": "a", "arguments": '
     '{"n": }</tool_call> after', []),  # malformed JSON: text
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('ok <tool_call>{"name": "a", "arguments": {}}', 'ok <tool_call>{"name": "a", "arguments": {}}', []),  # unclosed
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>tail', "tail", [("a", {})]),
    ('<tool_call>{"name": "a"} junk</tool_call><tool_call>{"name": "b"}</tool_call>',
     '<tool_call>{"name": "a"} junk</tool_call>', [("b", {})]),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
]

LLAMA = [
    ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}', "",
     [("get_weather", WEATHER)]),
    ('  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": [1, {"m": "}"}]}}', "",
     [("a", {}), ("b", {"n": [1, {"m": "}"}]})]),
    ('Sure. <|python_tag|>{"name": "a", "arguments": {"x": 1}}', "Sure. ", [("a", {"x": 1})]),
    ("plain {text} with <|python", "plain {text} with <|python", []),
    ('{"name": "a", "parameters": {"n": oops}}', '{"name": "a", "parameters": {"n": oops}}', []),
    ('{"name": "a", "parameters": {}} and then words', "and then words", [("a", {})]),
    ('{"name": "a", "parameters": {}}; {"nam', '{"nam', [("a", {})]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ("   ", "   ", []),
]

REQUIRED = [  # tool_choice required: the constrained output is a list of calls
    ('[{"name": "a", "parameters": ' + json.dumps(WEATHER) + '}, {"name": "b", "parameters": {}}]', "",
     [("a", WEATHER), ("b", {})]),
    ('  [ {"name": "a", "parameters": {"x": [1, 2]}} ]\n', "\n", [("a", {"x": [1, 2]})]),
    ('[{"name": "a", "parameters": {}}, {"name": "b", "para', '{"name": "b", "para', [("a", {})]),  # cut off
    ('[{"name": 1, "parameters": {}}]', '{"name": 1, "parameters": {}}]', []),
    ("not a list", "not a list", []),
]
CASES = ([(HermesParser, *case) for case in HERMES] + [(Llama3JsonParser, *case) for case in LLAMA]
         + [(RequiredCalls, *case) for case in REQUIRED])


def _decoded(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_text(parser, text, content, calls):
    got_content, got_calls = parse_whole(parser(), text)
    assert got_content == content
    assert _decoded(got_calls) == calls


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_every_split_agrees(parser, text, content, calls):
    whole = parse_whole(parser(), text)
    for at in range(len(text) + 1):
        p = parser()
        assert merged(p.feed(text[:at]) + p.feed(text[at:]) + p.finish()) == whole, at
    p = parser()
    events = [e for ch in text for e in p.feed(ch)] + p.finish()
    assert merged(events) == whole


def test_a_named_call_streams_its_arguments_as_they_come():
    p = NamedCall("f")
    assert merged(p.feed('{"a"')) == ("", [("f", '{"a"')])
    assert merged(p.feed(": 1}") + p.finish()) == ("", [])  # a fragment of the call begun above
    pieces = NamedCall("f")
    assert merged(pieces.feed('{"a"') + pieces.feed(": 1}") + pieces.finish()) == ("", [("f", '{"a": 1}')])


def test_content_streams_before_a_call_ends():
    """Text outside a call is sent as it comes (only a possible tag start waits)."""
    p = HermesParser()
    assert merged(p.feed("Hello <tool")) == ("Hello ", [])
    assert merged(p.feed("_call>{")) == ("", [])
    assert merged(p.feed('"name": "a"}</tool_call>')) == ("", [("a", "{}")])


def test_openai_deltas():
    ids = iter(["call_1", "call_2"])
    deltas = ToolDeltas(HermesParser(), new_id=lambda: next(ids))
    text = 'Hi<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    out = [d for ch in text for d in deltas.feed(ch)] + deltas.finish()
    assert out[0] == {"content": "H"}
    starts = [d for d in out if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert starts == [
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "a", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "b", "arguments": ""}}]},
    ]
    content, calls = message(out)
    assert content == "Hi"
    assert calls == [{"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
                     {"id": "call_2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]


def test_one_call_without_parallel_tool_calls():
    deltas = ToolDeltas(Llama3JsonParser(), parallel=False)
    content, calls = message(deltas.feed('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}')
                             + deltas.finish())
    assert content is None and [c["function"]["name"] for c in calls] == ["a"]


def test_registry():
    assert isinstance(parser_factory("hermes")(), HermesParser)
    assert isinstance(parser_factory("llama3_json")(), Llama3JsonParser)
    with pytest.raises(ValueError, match="^tool_call_parser: unknown parser 'nope'"):
        parser_factory("nope")

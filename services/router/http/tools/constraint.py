"""What tool_choice `required` or a named function puts on decoding (as vLLM does), and
how the constrained output becomes calls.

    named f      the output is f's arguments: f's parameters schema
    required     the output is a list of calls, at least one (exactly one without
                 parallel_tool_calls):
                 {"type": "array", "minItems": 1, "items": {"anyOf": [
                     {"type": "object", "properties": {"name": {"type": "string", "enum": [f]},
                      "parameters": <f's parameters>}, "required": ["name", "parameters"]}, ...]}}

Both are StructuredOutputs JSON schemas (engine/structured/), so every worker path that
honours a response_format honours a forced tool call too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.params import StructuredOutputs
from pdserve.services.router.http.errors import bad_request
from pdserve.services.router.http.tools.parsers import (
    ARGUMENTS_KEYS, CallArguments, CallStart, Event, Extractor, TextPart, leading_call,
)
from pdserve.services.router.http.tools.request import Tool, ToolRequest


def required_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                               "parameters": tool.schema},
              "required": ["name", "parameters"]} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constraint_of(tools: ToolRequest | None) -> StructuredOutputs | None:
    """The constraint a tool_choice puts on the output (None: auto / none, free text)."""
    if tools is None or not tools.constrained:
        return None
    if tools.named is not None:
        return StructuredOutputs.json_schema(tools.named.schema)
    return StructuredOutputs.json_schema(required_schema(tools.tools, tools.parallel))


class NamedCall(Extractor):
    """The named function's call: its name at once, then the text as its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            events.append(CallStart(self.name))
        if text:
            events.append(CallArguments(text))
        return events

    def finish(self) -> list[Event]:
        return self.feed("")


class RequiredCalls(Extractor):
    """A JSON list of calls, each announced once its object is complete. What does not
    read as that list (an output cut off by max_tokens) is text from where it stops."""

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "open"  # open (before '[') | item | after (an item ended) | text

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        """Settle what the buffer allows; False when it must wait for more text."""
        if self.state == "text":
            if self.buffer:
                events.append(TextPart(self.buffer))
                self.buffer = ""
            return False
        rest = self.buffer.lstrip()
        if not rest:
            return False
        if self.state == "open":
            self.state, self.buffer = ("item", rest[1:]) if rest[0] == "[" else ("text", rest)
            return True
        if self.state == "after":
            if rest[0] in ",]":
                self.state, self.buffer = ("item" if rest[0] == "," else "text"), rest[1:]
                return True
            self.state, self.buffer = "text", rest
            return True
        call, end = leading_call(rest, ARGUMENTS_KEYS)
        if end is None:
            self.buffer = rest
            return False
        if call is None:
            self.state, self.buffer = "text", rest
            return True
        events.extend(call)
        self.state, self.buffer = "after", rest[end:]
        return True

    def finish(self) -> list[Event]:
        events = [TextPart(self.buffer)] if self.buffer.strip() else []
        self.buffer, self.state = "", "open"
        return events


def with_tool_constraint(sampling: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
    """`sampling` constrained as tool_choice asks (unchanged under auto / none). Raises
    ApiError naming tool_choice beside another constraint, ValueError where SamplingParams
    refuses a constraint (beam search)."""
    constraint = constraint_of(tools)
    if constraint is None:
        return sampling
    if sampling.structured_outputs is not None:
        raise bad_request("tool_choice", "required or a named function constrains the output itself: it cannot go "
                                         "with response_format or structured_outputs")
    return replace(sampling, structured_outputs=constraint)

"""One choice's text -> its tool calls, in OpenAI's shapes.

    streamed   ToolDeltas.feed(text) / .finish() -> deltas, each one of
                 {"content": text}
                 {"tool_calls": [{"index", "id": "call_...", "type": "function",
                                  "function": {"name", "arguments": ""}}]}     a call begins
                 {"tool_calls": [{"index", "function": {"arguments": fragment}}]}
    whole      message(...) -> (content or None, [{"id", "type", "function": {"name",
                                                   "arguments"}}])

Without parallel_tool_calls only the first call is kept (later ones are dropped, not
turned into text). `finish_reason` is "tool_calls" when a call was made under auto or
required; a named function's answer finishes "stop", as OpenAI's does.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from pdserve.services.router.http.tools.constraint import NamedCall, RequiredCalls
from pdserve.services.router.http.tools.parsers import CallArguments, CallStart, Event, Extractor, TextPart
from pdserve.services.router.http.tools.request import ToolRequest


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def extractor_of(tools: ToolRequest, parser: Callable[[], Extractor]) -> Extractor | None:
    """What reads a choice's text under this tool_choice (None: "none", plain text)."""
    if tools.named is not None:  # tool_choice named a function
        return NamedCall(tools.named.name)
    if tools.choice == "required":
        return RequiredCalls()
    if tools.choice == "auto":
        return parser()
    return None


class ToolDeltas:
    def __init__(self, extractor: Extractor, parallel: bool = True, new_id: Callable[[], str] = call_id) -> None:
        self.extractor = extractor
        self.max_calls = None if parallel else 1
        self.new_id = new_id
        self.calls = 0  # calls begun (kept)
        self.dropping = False  # inside a call beyond max_calls

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.extractor.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self.extractor.finish())

    def _deltas(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, TextPart):
                self.dropping = False
                if out and "content" in out[-1]:
                    out[-1]["content"] += event.text
                else:
                    out.append({"content": event.text})
            elif isinstance(event, CallStart):
                self.dropping = self.max_calls is not None and self.calls >= self.max_calls
                if not self.dropping:
                    out.append({"tool_calls": [{"index": self.calls, "id": self.new_id(), "type": "function",
                                                "function": {"name": event.name, "arguments": ""}}]})
                    self.calls += 1
            elif isinstance(event, CallArguments) and not self.dropping and self.calls:
                out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": event.fragment}}]})
        return out


def message(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """The (content, tool_calls) of a choice's deltas: content None when it is only
    whitespace beside calls."""
    content, calls = [], []
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                calls.append({"id": call["id"], "type": "function",
                              "function": {"name": call["function"]["name"], "arguments": ""}})
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    text = "".join(content)
    if calls and not text.strip():
        return None, calls
    return text, calls


def whole(tools: ToolRequest, parser: Callable[[], Extractor], text: str) -> tuple[str | None, list[dict]]:
    """A whole choice's (content, tool_calls)."""
    extractor = extractor_of(tools, parser)
    if extractor is None:
        return text, []
    deltas = ToolDeltas(extractor, tools.parallel)
    return message(deltas.feed(text) + deltas.finish())


def finish_reason(tools: ToolRequest, reason: str, made_calls: bool) -> str:
    if made_calls and reason == "stop" and tools.choice in ("auto", "required"):
        return "tool_calls"
    return reason

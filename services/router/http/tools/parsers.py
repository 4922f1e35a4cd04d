"""Tool-call parsers: what a model writes when it calls a tool, read back incrementally.

A parser is fed the model's text in pieces as they are decoded and returns events:

    TextPart(text)            text outside any call (the message's content)
    CallStart(name)           a call begins; CallArguments follow for the same call
    CallArguments(fragment)   a piece of the current call's arguments (JSON text)

The invariant every parser keeps (and tests check at every split of a sample text): the
events of a text do not depend on how it was split, so a streamed answer and a whole
one agree. A call is announced only once its text is complete and parses, so a malformed
one (bad JSON, a missing name, cut off by max_tokens) comes back as text, never half-sent.

Parsers are registered by the name `--tool-call-parser` takes (registry.py); each
instance serves one choice of one request (it holds that choice's unread text).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured.params import bracket_depths


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class CallStart:
    name: str


@dataclass(frozen=True)
class CallArguments:
    fragment: str


Event = TextPart | CallStart | CallArguments


class Extractor(ABC):
    """Text in, events out; `finish` once the text has ended (what was held back is
    settled: an unfinished call is text)."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...


def call_events(obj: Any, arguments_keys: tuple[str, ...]) -> list[Event] | None:
    """A decoded call object's events ({"name": str, KEY: object or its JSON text}, KEY
    the first of `arguments_keys` present; none: no arguments), or None when `obj` is
    not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return [CallStart(obj["name"]), CallArguments(json.dumps(arguments, ensure_ascii=False))]


# the keys a JSON call object names its arguments by: Llama 3's `parameters`, else `arguments`
ARGUMENTS_KEYS = ("parameters", "arguments")


def leading_call(text: str, arguments_keys: tuple[str, ...]) -> tuple[list[Event] | None, int | None]:
    """The call object `text` (not empty, leading blanks stripped) starts with: (its
    events, its end); (None, None) while that object is still open; (None, 0) when
    `text` starts with no call (text, or a JSON object that is no call)."""
    if text[0] != "{":
        return None, 0
    end = json_object_end(text)
    if end is None:
        return None, None
    try:
        obj = json.loads(text[:end])
    except (ValueError, RecursionError):
        return None, 0
    call = call_events(obj, arguments_keys)
    return (call, end) if call is not None else (None, 0)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (and so must wait
    for the next piece before they are known to be text)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def json_object_end(text: str) -> int | None:
    """The end (exclusive) of the JSON object `text` starts with, by its brackets outside
    strings; None while it is still open. `text` must start with '{'."""
    return next((i + 1 for i, depth in bracket_depths(text) if depth == 0), None)


def merged(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    """(all text, [(name, arguments JSON)]) of a list of events."""
    text, calls = [], []
    for event in events:
        if isinstance(event, TextPart):
            text.append(event.text)
        elif isinstance(event, CallStart):
            calls.append((event.name, ""))
        elif calls:
            calls[-1] = (calls[-1][0], calls[-1][1] + event.fragment)
    return "".join(text), calls


def parse_whole(extractor: Extractor, text: str) -> tuple[str, list[tuple[str, str]]]:
    """A whole text's (content, [(name, arguments JSON)])."""
    return merged(extractor.feed(text) + extractor.finish())

"""The Hermes / Qwen tool-call format (and the embedded model's template):

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content; each block whose body is a JSON call object is a call.
The block ends at the first CLOSE after its JSON object (found by brackets outside
strings, so a string argument may hold "</tool_call>"). A block that does not parse is
content up to the first CLOSE, tags and all; one never closed is content too.
"""

from __future__ import annotations

import json

from pdserve.services.router.http.tools.parsers import (
    Event, Extractor, TextPart, call_events, held_back, json_object_end,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(Extractor):
    def __init__(self) -> None:
        self.buffer = ""  # unsettled text: a possible start of OPEN, or an open block
        self.inside = False  # the buffer starts with OPEN

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = held_back(self.buffer, OPEN)
                    _text(events, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return events
                _text(events, self.buffer[:at])
                self.buffer = self.buffer[at:]
                self.inside = True
            end = _block_end(self.buffer)
            if end is None:
                return events
            block, self.buffer = self.buffer[:end], self.buffer[end:]
            self.inside = False
            events.extend(_block(block) or [TextPart(block)])

    def finish(self) -> list[Event]:
        events: list[Event] = []
        _text(events, self.buffer)
        self.buffer, self.inside = "", False
        return events


def _block_end(buffer: str) -> int | None:
    """Where the block `buffer` starts with ends (after its CLOSE); None while that is
    not yet known."""
    body = buffer[len(OPEN):]
    start = len(buffer) - len(body.lstrip())
    if start == len(buffer):
        return None
    if buffer[start] == "{":
        end = json_object_end(buffer[start:])
        if end is None:
            return None
        after = buffer[start + end:]
        rest = after.lstrip()
        if not rest or (CLOSE.startswith(rest) and rest != CLOSE):
            return None
        if rest.startswith(CLOSE):
            return len(buffer) - len(rest) + len(CLOSE)
    close = buffer.find(CLOSE, len(OPEN))  # not a call: text up to the first CLOSE
    return None if close < 0 else close + len(CLOSE)


def _block(block: str) -> list[Event] | None:
    try:
        obj = json.loads(block[len(OPEN):-len(CLOSE)])
    except (ValueError, RecursionError):
        return None
    return call_events(obj, ("arguments", "parameters"))


def _text(events: list[Event], text: str) -> None:
    if text:
        events.append(TextPart(text))

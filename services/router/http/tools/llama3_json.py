"""Llama 3's JSON tool-call format: the message is one or more call objects separated by
';', after `<|python_tag|>` or at the very start of the text:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
    {"name": "get_weather", "parameters": {"city": "Paris"}}

Text before the tag is content; so is whatever follows the calls that is not another
call (a malformed object, or text where ';' or the end should be), from that point on.
"""

from __future__ import annotations

from pdserve.services.router.http.tools.parsers import (
    ARGUMENTS_KEYS, Event, Extractor, TextPart, held_back, leading_call,
)

TAG = "<|python_tag|>"


class Llama3JsonParser(Extractor):
    def __init__(self) -> None:
        self.buffer = ""
        self.state = "start"  # start (only whitespace so far) | text | calls
        self.after_call = False  # in calls: a call ended, ';' or the end comes next

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        """Settle what the buffer allows; False when it must wait for more text."""
        if self.state == "start":
            rest = self.buffer.lstrip()
            if not rest or TAG.startswith(rest):
                return False
            if rest.startswith("{"):
                self.state, self.buffer = "calls", rest  # leading whitespace is no content
                return True
            self.state = "text"
        if self.state == "text":
            at = self.buffer.find(TAG)
            if at < 0:
                keep = held_back(self.buffer, TAG)
                _text(events, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return False
            _text(events, self.buffer[:at])
            self.buffer, self.state, self.after_call = self.buffer[at + len(TAG):], "calls", False
            return True
        rest = self.buffer.lstrip()
        if not rest:
            return False
        if self.after_call:
            if rest[0] != ";":
                self.state, self.buffer = "text", rest
                return True
            self.buffer, self.after_call = rest[1:], False
            return True
        call, end = leading_call(rest, ARGUMENTS_KEYS)
        if end is None:
            self.buffer = rest
            return False
        if call is None:
            self.state, self.buffer = "text", rest
            return True
        events.extend(call)
        self.buffer, self.after_call = rest[end:], True
        return True

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.state != "calls" or self.buffer.strip():
            _text(events, self.buffer)
        self.buffer, self.state, self.after_call = "", "start", False
        return events


def _text(events: list[Event], text: str) -> None:
    if text:
        events.append(TextPart(text))

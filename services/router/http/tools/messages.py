"""A conversation's tool turns as the chat template takes them:

    {"role": "assistant", "content": ..., "tool_calls": [{"id", "type": "function",
        "function": {"name", "arguments": <a dict: the JSON string the client sent, decoded>}}]}
    {"role": "tool", "tool_call_id": ..., "content": ...}

Templates (Hermes, Qwen, Llama 3, ours) write `arguments | tojson`, so the arguments go
to them decoded, as vLLM sends them. A malformed turn is a 400 naming its field.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.services.router.http.errors import bad_request


def tool_fields(i: int, role: str, tool_calls: list[Any] | None, tool_call_id: str | None) -> dict[str, Any]:
    """The keys message `i` adds for the template (none for a turn without tools)."""
    where = f"messages.{i}"
    if role == "tool":
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise bad_request(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        return {"tool_call_id": tool_call_id}
    if tool_calls is None:
        return {}
    if role != "assistant":
        raise bad_request(f"{where}.tool_calls", "only assistant messages carry tool calls")
    return {"tool_calls": [_call(f"{where}.tool_calls.{j}", call) for j, call in enumerate(tool_calls)]} \
        if tool_calls else {}


def _call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise bad_request(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where}.function.name", "must be a string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as e:
            raise bad_request(f"{where}.function.arguments", f"not JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments", "must be a JSON object")
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out

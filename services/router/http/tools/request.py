"""A chat request's tools, checked: what `tools`, `tool_choice` and
`parallel_tool_calls` ask, or a 400 naming the field.

    tools         [{"type": "function", "function": {"name", "description"?, "parameters"?,
                   "strict"?}}]; names as OpenAI's (1-64 of a-z A-Z 0-9 _ -), each once;
                  parameters a JSON schema (jsonschema's metaschema check)
    tool_choice   "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
                  (default: "auto" with tools, "none" without); a named function must be
                  one of the tools
    parallel_tool_calls   false: at most one call
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured.params import MAX_NESTING
from pdserve.services.router.http.errors import bad_request

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # None: the request gave none (no arguments)

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' schema (an object with no properties when none was given)."""
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS

    def template_entry(self) -> dict[str, Any]:
        """As the chat template takes it (`tools=` of apply_chat_template)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """`choice`: "none" | "auto" | "required" | "named" (then `named` is the tool)."""

    tools: tuple[Tool, ...]
    choice: str
    named: Tool | None = None
    parallel: bool = True

    @property
    def parses_text(self) -> bool:
        """Whether the model's free text is parsed for calls (tool_choice auto)."""
        return self.choice == "auto"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.template_entry() for tool in self.tools]


def tool_request(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
    """The request's tools, checked (None when it has none and tool_choice allows that).
    Raises ApiError 400 naming the field."""
    checked = tuple(_tool(i, t) for i, t in enumerate(tools or ()))
    if len(checked) > MAX_TOOLS:
        raise bad_request("tools", f"at most {MAX_TOOLS} tools, got {len(checked)}")
    names: dict[str, int] = {}
    for i, tool in enumerate(checked):
        if tool.name in names:
            raise bad_request(f"tools.{i}.function.name", f"{tool.name!r} is also tools.{names[tool.name]}'s name")
        names[tool.name] = i
    choice, named = _choice(tool_choice, checked, names)
    if not checked:
        if choice not in ("none", "auto") or tool_choice not in (None, "none"):
            raise bad_request("tool_choice", f"{_show(tool_choice)} needs tools")
        return None
    return ToolRequest(checked, choice, named, parallel_tool_calls is not False)


def _tool(i: int, tool: Any) -> Tool:
    where = f"tools.{i}"
    if not isinstance(tool, dict):
        raise bad_request(where, f"must be an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type", f"must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function", "must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"{where}.function.name", f"must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description", "must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict", "must be a boolean")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_schema(f"{where}.function.parameters", parameters)
    return Tool(name, description, parameters)


def _check_schema(where: str, schema: Any) -> None:
    """A JSON schema, by jsonschema's metaschema (of the draft it names; 2020-12 else),
    and an object at its top: a call's arguments are one."""
    if not isinstance(schema, dict):
        raise bad_request(where, f"must be a JSON schema object, got {type(schema).__name__}")
    if _depth(schema) > MAX_NESTING:
        raise bad_request(where, f"nested more than {MAX_NESTING} deep")
    import jsonschema  # the router's check before dispatch; loads once

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise bad_request(where, f"not a valid JSON schema{' at ' + path if path else ''}: {e.message}") from None
    except RecursionError:
        raise bad_request(where, "nested too deep to check") from None
    if schema.get("type", "object") != "object":
        raise bad_request(where, f"must describe an object (a call's arguments), got type {schema.get('type')!r}")


def _depth(value: Any) -> int:
    """How deeply decoded JSON nests (objects and arrays), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_NESTING:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _choice(tool_choice: Any, tools: tuple[Tool, ...], names: dict[str, int]) -> tuple[str, Tool | None]:
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise bad_request("tool_choice", f"must be one of {', '.join(CHOICES)} or a named function, "
                                             f"got {tool_choice!r}")
        return tool_choice, None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise bad_request("tool_choice", 'a named function is {"type": "function", "function": {"name": ...}}')
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice.function.name", "must be a string")
    if name not in names:
        raise bad_request("tool_choice.function.name", f"{name!r} is not one of the tools "
                                                       f"({', '.join(sorted(names)) or 'none given'})")
    return "named", tools[names[name]]


def _show(tool_choice: Any) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else "a named function"

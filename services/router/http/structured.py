"""A body's structured-outputs fields -> at most one StructuredOutputs, and the name
of the field the caller used (what its errors name).

    response_format     {"type": "text"}                                     none
                        {"type": "json_object"}                              JSON_OBJECT
                        {"type": "json_schema", "json_schema":
                           {"name", "schema", "strict", "description"}}      JSON_SCHEMA
    structured_outputs  {"json": schema (object or its text)}                JSON_SCHEMA   (vLLM)
                        {"regex": str} {"choice": [str]} {"grammar": str}    REGEX CHOICE GRAMMAR
                        {"json_object": true}                                JSON_OBJECT
    guided_json, guided_regex, guided_choice, guided_grammar                 vLLM's older names

At most one constraint a request: two (in one object or across fields) are a 400
naming both. `strict` is taken whatever its value: output is always constrained to
the schema (OpenAI's strict mode). vLLM's options that change what is generated
(`structural_tag`, `whitespace_pattern`, `disable_any_whitespace`,
`disable_additional_properties`, `guided_whitespace_pattern`) are refused by name when
set, never ignored; `disable_fallback` is taken (pdserve never falls back to another
backend).

`guided_decoding_backend` (and `structured_outputs.backend`): the backend is the
workers' --structured-outputs-backend, one for the cluster. vLLM V1 refuses a request
naming another; the router cannot tell which one its workers run (they do not
register it), so a known name (xgrammar, llguidance, guidance, auto) is accepted and
the server's backend used, and an unknown one is a 400. The grammar syntax is the
backend's (GBNF for xgrammar, Lark for llguidance): a grammar in the other syntax is
refused by the worker (400), not misread.

Errors of the constraint past this point (the router's checks, structured.py, and a
worker's refusal) name `structured_outputs.<kind>`; `aliases(body)` renames that to
the caller's field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs
from pdserve.services.router.http.errors import renamed
from pdserve.services.router.structured import ConstraintRefused

BACKENDS = ("xgrammar", "llguidance", "guidance", "auto")
# vLLM's structured_outputs keys -> kinds
_KEYS = {"json": ConstraintKind.JSON_SCHEMA, "regex": ConstraintKind.REGEX, "choice": ConstraintKind.CHOICE,
         "grammar": ConstraintKind.GRAMMAR, "json_object": ConstraintKind.JSON_OBJECT}
_GUIDED = {"guided_json": ConstraintKind.JSON_SCHEMA, "guided_regex": ConstraintKind.REGEX,
           "guided_choice": ConstraintKind.CHOICE, "guided_grammar": ConstraintKind.GRAMMAR}
# Options that would change what is generated, which pdserve does not do: refused when set.
_REFUSED_OPTIONS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True)
class _Given:
    field: str  # as the caller named it: "response_format", "structured_outputs.regex", "guided_json"
    kind: ConstraintKind
    value: Any


def constraint_of(body: Any) -> StructuredOutputs | None:
    """The constraint a body asks for (None: none). Raises ConstraintRefused (a
    ValueError) naming the caller's field: a malformed value, two constraints."""
    given = _given(body)
    if not given:
        return None
    if len(given) > 1:
        first, second = given[0].field, given[1].field
        raise ConstraintRefused(f"{first}: conflicts with {second}: a request takes one structured-outputs "
                                f"constraint", "conflict")
    one = given[0]
    try:
        return _build(one)
    except ConstraintRefused:
        raise
    except ValueError as e:
        raise ConstraintRefused(renamed(str(e), _names(one.field)), "malformed") from None


def aliases(body: Any) -> dict[str, str]:
    """`structured_outputs[.<kind>]` -> the field the caller used, for the errors of a
    constraint (empty when the body has none, or more than one)."""
    try:
        given = _given(body)
    except ValueError:
        return {}
    return _names(given[0].field) if len(given) == 1 else {}


def _names(field: str) -> dict[str, str]:
    """What the layers below call a constraint -> `field`."""
    return {"structured_outputs": field, **{f"structured_outputs.{kind.value}": field for kind in ConstraintKind}}


def _given(body: Any) -> list[_Given]:
    """Every constraint a body sets, in the order the module docstring lists the fields."""
    given: list[_Given] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        one = _response_format(response_format)
        if one is not None:
            given.append(one)
    options = getattr(body, "structured_outputs", None)
    if options is not None:
        given.extend(_structured_outputs(options))
    for name, kind in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            given.append(_Given(name, kind, value))
    _check_backend(getattr(body, "guided_decoding_backend", None), "guided_decoding_backend")
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        raise ConstraintRefused("guided_whitespace_pattern: not supported by pdserve (send none)", "malformed")
    return given


def _response_format(value: Any) -> _Given | None:
    if not isinstance(value, dict):
        raise ConstraintRefused("response_format: must be an object with a `type`", "malformed")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _Given("response_format", ConstraintKind.JSON_OBJECT, True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintRefused("response_format.json_schema: must be an object with a `schema`", "malformed")
        schema = spec.get("schema", spec.get("json_schema"))  # vLLM also reads the alias
        if schema is None:
            raise ConstraintRefused("response_format.json_schema.schema: required", "malformed")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise ConstraintRefused("response_format.json_schema.name: must be a string", "malformed")
        return _Given("response_format.json_schema", ConstraintKind.JSON_SCHEMA, schema)
    raise ConstraintRefused(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                            "malformed")


def _structured_outputs(options: Any) -> list[_Given]:
    if not isinstance(options, dict):
        raise ConstraintRefused("structured_outputs: must be an object", "malformed")
    for name in _REFUSED_OPTIONS:
        if options.get(name) not in (None, False):
            raise ConstraintRefused(f"structured_outputs.{name}: not supported by pdserve (send none)", "malformed")
    _check_backend(options.get("backend"), "structured_outputs.backend")
    out = []
    for key, kind in _KEYS.items():
        value = options.get(key)
        if value is None or (key == "json_object" and value is False):
            continue
        out.append(_Given(f"structured_outputs.{key}", kind, value))
    return out


def _check_backend(name: Any, field: str) -> None:
    if name is None:
        return
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ConstraintRefused(f"{field}: unknown backend {name!r}; this server runs one of {', '.join(BACKENDS)} "
                                f"(its workers' --structured-outputs-backend; a request cannot choose)", "malformed")


def _build(one: _Given) -> StructuredOutputs:
    kind, value, name = one.kind, one.value, one.field
    if kind is ConstraintKind.JSON_OBJECT:
        if value is not True:
            raise ConstraintRefused(f"{name}: must be true", "malformed")
        return StructuredOutputs(kind)
    if kind is ConstraintKind.JSON_SCHEMA:
        if not isinstance(value, (dict, bool, str)):
            raise ConstraintRefused(f"{name}: a schema is a JSON object (or its text), got {type(value).__name__}",
                                    "malformed")
        return StructuredOutputs.json_schema(value)
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, list):
            raise ConstraintRefused(f"{name}: must be a list of strings", "malformed")
        return StructuredOutputs(kind, choices=tuple(value))
    if not isinstance(value, str):
        raise ConstraintRefused(f"{name}: must be a string, got {type(value).__name__}", "malformed")
    return StructuredOutputs(kind, value)

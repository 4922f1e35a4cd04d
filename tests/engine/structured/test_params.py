"""StructuredOutputs against hostile input: every refusal is a ValueError naming the field,
never a crash (no RecursionError, no parse of a megabyte of brackets)."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.structured.params import MAX_NESTING, MAX_SPEC_BYTES, ConstraintKind, StructuredOutputs, json_depth

JSON = ConstraintKind.JSON_SCHEMA


@pytest.mark.parametrize("text", ['{"type": "object"', "not json", "[1, 2", '{"a": NaN}'])
def test_invalid_json_is_refused_by_name(text):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json_schema: not (valid )?JSON"):
        StructuredOutputs(JSON, text)


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', "3"])
def test_a_schema_is_an_object(text):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json_schema: a schema is a JSON object"):
        StructuredOutputs(JSON, text)


def test_huge_spec_is_refused_before_parsing():
    text = json.dumps({"type": "object", "description": "x" * MAX_SPEC_BYTES})
    with pytest.raises(ValueError, match=r"^structured_outputs\.json_schema: \d+ bytes, more than"):
        StructuredOutputs(JSON, text)
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: \d+ bytes"):
        StructuredOutputs(ConstraintKind.REGEX, "a" * (MAX_SPEC_BYTES + 1))
    with pytest.raises(ValueError, match=r"^structured_outputs\.choice: \d+ bytes"):
        StructuredOutputs(ConstraintKind.CHOICE, choices=("x" * 1000,) * 1100)


def test_deep_nesting_is_counted_not_recursed():
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000  # json.loads would hit the recursion limit
    with pytest.raises(ValueError,
                       match=rf"^structured_outputs\.json_schema: nested 100000 deep, more than {MAX_NESTING}"):
        StructuredOutputs(JSON, deep)
    assert json_depth('{"a": "[[[[{{{{", "b": [{"c": []}]}') == 4  # brackets inside strings do not count
    assert json_depth('{"a": "\\"[[", "b": 1}') == 1  # nor after an escaped quote


def test_nesting_depth_of_a_schema():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object"}}}}
    assert StructuredOutputs.json_schema(schema).nesting_depth() == 4
    assert StructuredOutputs(ConstraintKind.REGEX, "[[[").nesting_depth() == 0


def test_recursive_ref_schema_is_accepted_here_and_keyed_canonically():
    """A schema that refers to itself is valid JSON (whether it can ever end is for the
    grammar engine, tests/engine/structured/test_backends.py)."""
    schema = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
              "$ref": "#/$defs/n"}
    a = StructuredOutputs.json_schema(schema)
    b = StructuredOutputs(JSON, json.dumps(schema, indent=2))
    assert a.spec == b.spec and a.key == b.key  # whitespace does not change the cache key
    assert a.key != StructuredOutputs(ConstraintKind.REGEX, a.spec).key


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "nope"}, r"^structured_outputs: unknown kind 'nope'"),
    ({"kind": "choice", "choices": ()}, r"^structured_outputs\.choice: must hold 1 to"),
    ({"kind": "choice", "choices": ("a", "")}, r"^structured_outputs\.choice: every choice"),
    ({"kind": "choice", "choices": "ab"}, r"^structured_outputs\.choice: must be a list"),
    ({"kind": "regex", "spec": "  "}, r"^structured_outputs\.regex: must not be empty"),
    ({"kind": "grammar", "spec": ""}, r"^structured_outputs\.grammar: must not be empty"),
    ({"kind": "json_object", "spec": "{}"}, r"^structured_outputs\.json_object: takes no schema"),
    ({"kind": "regex", "spec": "a", "choices": ("a",)}, r"^structured_outputs\.regex: takes no choices"),
])
def test_malformed_constraints_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputs(**kwargs)

"""Structured outputs and logit_bias in the HTTP request bodies, without a cluster
(services/router/http/structured.py, protocol.py): every field form to its
StructuredOutputs, one constraint a request (two: a 400 naming both), logit_bias's
forms, and every bad value a ValueError (a 400) naming the field the caller used;
hypothesis: any JSON in a constraint field is a constraint or such a refusal."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.http.errors import ApiError, api_error_of, param_of
from pdserve.services.router.http.protocol import ChatCompletionRequest, CompletionRequest, parse, sampling_of
from pdserve.services.router.http.structured import aliases
from pdserve.services.router.structured import ConstraintLimits, ConstraintRefused, check_constraint

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))
CHAT = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, json.dumps({"messages": CHAT, **fields}).encode())


def completion(**fields) -> CompletionRequest:
    return parse(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())


def constraint(body) -> StructuredOutputs | None:
    return sampling_of(body, 16, None).structured_outputs


def refused(body) -> ConstraintRefused | ValueError:
    with pytest.raises(ValueError) as info:
        sampling_of(body, 16, None)
    return info.value


JSON_SCHEMA = StructuredOutputs(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)


@pytest.mark.parametrize("fields, want", [
    (dict(response_format={"type": "text"}), None),
    (dict(response_format={"type": "json_object"}), StructuredOutputs(ConstraintKind.JSON_OBJECT)),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                  "strict": True}}), JSON_SCHEMA),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}), JSON_SCHEMA),
    (dict(structured_outputs={"json": SCHEMA}), JSON_SCHEMA),
    (dict(structured_outputs={"json": SCHEMA_TEXT}), JSON_SCHEMA),
    (dict(structured_outputs={"regex": r"\d{3}-\d{4}"}), StructuredOutputs(ConstraintKind.REGEX, r"\d{3}-\d{4}")),
    (dict(structured_outputs={"choice": ["yes", "no"]}), StructuredOutputs(ConstraintKind.CHOICE, choices=("yes", "no"))),
    (dict(structured_outputs={"grammar": 'root ::= "a"+'}), StructuredOutputs(ConstraintKind.GRAMMAR, 'root ::= "a"+')),
    (dict(structured_outputs={"json_object": True}), StructuredOutputs(ConstraintKind.JSON_OBJECT)),
    (dict(structured_outputs={"json_object": False}), None),
    (dict(structured_outputs={"regex": "a+", "json_object": False, "disable_fallback": True}),
     StructuredOutputs(ConstraintKind.REGEX, "a+")),
    (dict(guided_json=SCHEMA), JSON_SCHEMA),
    (dict(guided_json=SCHEMA_TEXT), JSON_SCHEMA),
    (dict(guided_regex="a|b"), StructuredOutputs(ConstraintKind.REGEX, "a|b")),
    (dict(guided_choice=["x", "y"]), StructuredOutputs(ConstraintKind.CHOICE, choices=("x", "y"))),
    (dict(guided_grammar='root ::= "x"'), StructuredOutputs(ConstraintKind.GRAMMAR, 'root ::= "x"')),
    (dict(guided_regex="a", guided_decoding_backend="xgrammar"), StructuredOutputs(ConstraintKind.REGEX, "a")),
    (dict(guided_regex="a", guided_decoding_backend="llguidance"), StructuredOutputs(ConstraintKind.REGEX, "a")),
    (dict(), None),
])
def test_every_field_form_maps_to_its_constraint_on_both_endpoints(fields, want):
    assert constraint(chat(**fields)) == want
    assert constraint(completion(**fields)) == want


def test_a_schemas_key_order_is_kept_it_is_the_order_properties_are_generated_in():
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}}}
    got = constraint(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert list(json.loads(got.spec)["properties"]) == ["z", "a"]


@pytest.mark.parametrize("fields, first, second", [
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "response_format", "guided_regex"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}, structured_outputs={"regex": "a"}),
     "response_format.json_schema", "structured_outputs.regex"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs.regex", "structured_outputs.choice"),
    (dict(guided_json=SCHEMA, guided_choice=["a"]), "guided_json", "guided_choice"),
    (dict(structured_outputs={"json_object": True}, guided_grammar="root ::= x"), "structured_outputs.json_object",
     "guided_grammar"),
])
def test_two_constraints_are_refused_naming_both(fields, first, second):
    for body in (chat(**fields), completion(**fields)):
        error = refused(body)
        assert isinstance(error, ConstraintRefused) and error.reason == "conflict"
        assert param_of(str(error)) == first and second in str(error)


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(response_format={}), "response_format.type"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": 5, "schema": SCHEMA}}),
     "response_format.json_schema.name"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": "{not json"}}),
     "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": "[1, 2]"}}), "response_format.json_schema"),
    (dict(structured_outputs={"json": [1]}), "structured_outputs.json"),
    (dict(structured_outputs={"json": "nope"}), "structured_outputs.json"),
    (dict(structured_outputs={"regex": ""}), "structured_outputs.regex"),
    (dict(structured_outputs={"regex": 5}), "structured_outputs.regex"),
    (dict(structured_outputs={"choice": []}), "structured_outputs.choice"),
    (dict(structured_outputs={"choice": "yes"}), "structured_outputs.choice"),
    (dict(structured_outputs={"choice": ["a", 5]}), "structured_outputs.choice"),
    (dict(structured_outputs={"choice": ["a", ""]}), "structured_outputs.choice"),
    (dict(structured_outputs={"grammar": "  "}), "structured_outputs.grammar"),
    (dict(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
    (dict(structured_outputs={"regex": "a", "structural_tag": "{}"}), "structured_outputs.structural_tag"),
    (dict(structured_outputs={"regex": "a", "disable_any_whitespace": True}),
     "structured_outputs.disable_any_whitespace"),
    (dict(structured_outputs={"regex": "a", "backend": "outlines"}), "structured_outputs.backend"),
    (dict(guided_json=5), "guided_json"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(guided_regex=["a"]), "guided_regex"),
    (dict(guided_regex="a", guided_decoding_backend="outlines"), "guided_decoding_backend"),
    (dict(guided_regex="a", guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
])
def test_a_bad_value_is_refused_naming_the_field_the_caller_used(fields, param):
    for body in (chat(**fields), completion(**fields)):
        error = refused(body)
        assert isinstance(error, ConstraintRefused) and error.reason == "malformed", error
        assert param_of(str(error)) == param, str(error)


def test_structured_outputs_must_be_an_object():
    error = parse_error(dict(structured_outputs=["regex"]))
    assert error == "structured_outputs"


def parse_error(fields) -> str | None:
    with pytest.raises(ApiError) as info:
        chat(**fields)
    return info.value.param


@pytest.mark.parametrize("bias, want", [
    ({"5": -100}, ((5, -100.0),)),
    ({"7": 1.5, "3": 100}, ((3, 100.0), (7, 1.5))),
    ({}, ()),
    (None, ()),
])
def test_logit_bias_maps_token_id_strings_to_biases(bias, want):
    assert sampling_of(chat(logit_bias=bias), 16, None).logit_bias == want
    assert sampling_of(completion(logit_bias=bias), 16, None).logit_bias == want


@pytest.mark.parametrize("bias", [{"five": 1}, {"-1": 1}, {"5": 101}, {"5": -100.5}, {str(i): 1 for i in range(1025)}])
def test_a_bad_logit_bias_is_refused_naming_it(bias):
    error = refused(chat(logit_bias=bias))
    assert param_of(str(error)) == "logit_bias"


def test_a_logit_bias_of_the_wrong_type_is_a_400_naming_it():
    assert parse_error(dict(logit_bias={"5": "x"})).startswith("logit_bias")
    assert parse_error(dict(logit_bias=[5])) == "logit_bias"


def test_constraint_and_logit_bias_are_refused_with_beam_search_by_name():
    error = refused(completion(use_beam_search=True, n=2, guided_regex="a"))
    assert param_of(str(error)) == "structured_outputs"
    error = refused(completion(use_beam_search=True, n=2, logit_bias={"1": 1}))
    assert param_of(str(error)) == "logit_bias"


@pytest.mark.parametrize("fields, field", [
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}), "response_format.json_schema"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(structured_outputs={"json": SCHEMA}), "structured_outputs.json"),
    (dict(guided_json=SCHEMA), "guided_json"),
    (dict(guided_regex="a"), "guided_regex"),
])
def test_later_errors_of_a_constraint_name_the_callers_field(fields, field):
    """The router's checks and a worker's refusal name `structured_outputs[.kind]`;
    the HTTP error names the field the caller used, in `param` and the message."""
    names = aliases(chat(**fields))
    for message in ("structured_outputs.json_schema: not a valid JSON schema", "structured_outputs: refused by x"):
        for status, http in ((Status.INVALID_ARGUMENT, 400), (Status.DEADLINE_EXCEEDED, 504)):
            error = api_error_of(ServeError(status, message), None, names)
            assert error.status == http and error.message.startswith(f"{field}:")
            assert error.param == (field if http == 400 else None)
    other = api_error_of(ServeError(Status.INVALID_ARGUMENT, "n: must be <= 4"), None, names)
    assert (other.message, other.param) == ("n: must be <= 4", "n")  # other fields as they are
    assert aliases(chat()) == {}


# -- hostile bodies: never anything but a 400 naming a field -------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["", "object", "string", "#/$defs/a",
                                                                            "a+", "(", "x"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
        st.sampled_from(["type", "properties", "items", "required", "enum", "$ref", "$defs", "$schema", "anyOf",
                         "minLength", "pattern", "json", "regex", "choice", "grammar", "json_object", "schema",
                         "json_schema", "name", "strict", "backend"]), inner, max_size=4)),
    max_leaves=12,
)
FIELD = re.compile(r"^[A-Za-z_][\w.\[\]$]*: ")


@settings(deadline=None, max_examples=300, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                        "guided_grammar", "guided_decoding_backend"]), json_values)
def test_any_constraint_field_value_is_a_constraint_or_a_refusal_naming_a_field(field, value):
    """A body's constraint field, whatever JSON it holds: a StructuredOutputs that the
    router's checks accept or refuse naming the field, never another exception."""
    try:
        body = chat(**{field: value})
    except Exception as e:  # pydantic's refusal of the field's type: a 400 naming it
        assert isinstance(e, ApiError) and e.param.startswith(field), e
        return
    try:
        got = sampling_of(body, 16, None).structured_outputs
    except ValueError as e:
        assert FIELD.match(str(e)), str(e)
        return
    if got is not None:
        try:
            check_constraint(got, ConstraintLimits())
        except ValueError as e:
            assert str(e).startswith("structured_outputs."), str(e)

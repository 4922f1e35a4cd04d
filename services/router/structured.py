"""The router's checks of a structured-outputs constraint, before any worker sees it.

    StructuredOutputs (engine/structured/params.py: kind, JSON that parses, hard caps)
        check_constraint(constraint, limits)      ConstraintRefused naming the field:
            size  <= --structured-outputs-max-bytes       reason "too_large"
            depth <= --structured-outputs-max-depth       reason "too_deep"   (JSON schemas)
            a JSON schema valid against its metaschema    reason "invalid_schema"

The limits mirror the workers' (EngineConfig structured_outputs_max_bytes /
structured_outputs_max_depth, the same flags on `pdserve up` and the workers), so a
constraint the router accepts is one every worker admits; the router's check only
spares the workers' time.

The metaschema is the one the schema's `$schema` names (Draft 4, 6, 7, 2019-09,
2020-12), else Draft 2020-12 (an unknown `$schema` too: the backends do not read it).
Formats are not checked (`format_checker=None`): jsonschema's "regex" format check is
Python's `re`, which refuses ECMA-262 patterns the backends take (`\\p{L}`).

What is left to the worker, on purpose: regexes and grammars (a regex is the backend's
dialect, not Python's: `re` would refuse some that xgrammar or llguidance accept, and
accept some they refuse), and schema features a backend does not support. The worker
fails those requests alone, INVALID_ARGUMENT with FailureKind INVALID_CONSTRAINT
(dispatch.py passes it on, never retried elsewhere).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from pdserve.engine.structured.params import MAX_NESTING, MAX_SPEC_BYTES, ConstraintKind, StructuredOutputs

# The workers' defaults (EngineConfig structured_outputs_max_bytes / _max_depth, the
# worker's flags of the same names): keep them equal.
DEFAULT_MAX_BYTES = 64 << 10
DEFAULT_MAX_DEPTH = 32
MAX_QUOTED = 300  # characters of jsonschema's message an error quotes
# Refusals by reason (pdserve:router_structured_outputs_refusals_total{reason}): the
# router's, then a worker's (its FailureKind, as dispatch.py classifies it; the names
# the workers' own structured_outputs_refusals use).
REFUSAL_REASONS = ("malformed", "conflict", "too_large", "too_deep", "invalid_schema", "invalid", "timeout")


class ConstraintRefused(ValueError):
    """A constraint refused before dispatch; the message starts with the field
    ("structured_outputs.json_schema: ..."), `reason` is one of REFUSAL_REASONS."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ConstraintLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self) -> None:
        if not 1 <= self.max_bytes <= MAX_SPEC_BYTES:
            raise ValueError(f"structured_outputs_max_bytes: must be in [1, {MAX_SPEC_BYTES}], got {self.max_bytes}")
        if not 1 <= self.max_depth <= MAX_NESTING:
            raise ValueError(f"structured_outputs_max_depth: must be in [1, {MAX_NESTING}], got {self.max_depth}")


def field_of(constraint: StructuredOutputs) -> str:
    return f"structured_outputs.{constraint.kind.value}"


def check_constraint(constraint: StructuredOutputs, limits: ConstraintLimits) -> None:
    """Raise ConstraintRefused naming the field when the router can tell the workers
    would refuse `constraint` (the module docstring)."""
    name = field_of(constraint)
    size = constraint.size_bytes
    if size > limits.max_bytes:
        raise ConstraintRefused(f"{name}: {size} bytes, more than {limits.max_bytes} "
                                f"(--structured-outputs-max-bytes)", "too_large")
    depth = constraint.nesting_depth()
    if depth > limits.max_depth:
        raise ConstraintRefused(f"{name}: nested {depth} deep, more than {limits.max_depth} "
                                f"(--structured-outputs-max-depth)", "too_deep")
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        check_schema(json.loads(constraint.spec), name)


def check_schema(schema: object, name: str) -> None:
    """`schema` is valid against its metaschema (ConstraintRefused naming `name` if not)."""
    if isinstance(schema, bool):  # true / false: valid schemas of every draft
        return
    if not isinstance(schema, dict):
        raise ConstraintRefused(f"{name}: a schema is a JSON object, got {type(schema).__name__}", "invalid_schema")
    declared = schema.get("$schema", "")
    if not isinstance(declared, str):
        raise ConstraintRefused(f"{name}: $schema must be a URI string, got {type(declared).__name__}",
                                "invalid_schema")
    validator = validator_for(schema, default=Draft202012Validator)
    try:
        validator.check_schema(schema, format_checker=None)
    except SchemaError as e:
        where = "/".join(str(part) for part in e.absolute_path) or "(root)"
        message = e.message if len(e.message) <= MAX_QUOTED else e.message[:MAX_QUOTED] + "..."
        raise ConstraintRefused(f"{name}: not a valid JSON schema ({validator.__name__.removesuffix('Validator')}): "
                                f"{message}, at {where}", "invalid_schema") from None
    except RecursionError:  # below the depth cap this cannot happen; never a 500 if it does
        raise ConstraintRefused(f"{name}: nested too deeply to check", "too_deep") from None

"""What a request's output must match (structured outputs), as every layer takes it.

One constraint per request, one of five kinds, as vLLM's `structured_outputs` names them:

    JSON_SCHEMA   a JSON schema (the text of a JSON object)     {"type": "object", ...}
    JSON_OBJECT   any JSON object                                (OpenAI's json_object)
    REGEX         a regular expression the whole output matches
    CHOICE        exactly one of a list of strings
    GRAMMAR       a context-free grammar in the backend's syntax (EBNF / GBNF for
                  xgrammar, Lark for llguidance)

Torch-free and grammar-engine-free: the router builds and checks these before any
worker sees them. What is checked here holds whatever the server: a known kind, text
where text belongs, JSON that parses to an object, a size and nesting depth below the
hard caps. The server's own, lower limits (flags) and a JSON schema's validity against
its metaschema are checked by `check_constraint` (engine/validation.py and the router).
Compiling, and whatever only compiling finds (a regex or grammar the backend refuses,
a schema feature it does not support), happens on the worker (engine/structured/).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

# Hard caps, whatever the flags say: a request message is at most a few MB.
MAX_SPEC_BYTES = 1 << 20
MAX_NESTING = 1024
MAX_CHOICES = 4096


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output. `spec`: the schema's JSON text (compact, key
    order kept: it is the order properties are generated in), the regex or the grammar;
    empty for JSON_OBJECT and CHOICE. `choices`: CHOICE's strings."""

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        name = "structured_outputs"
        if isinstance(self.kind, str):
            try:
                object.__setattr__(self, "kind", ConstraintKind(self.kind))
            except ValueError:
                raise ValueError(f"{name}: unknown kind {self.kind!r} (one of "
                                 f"{', '.join(k.value for k in ConstraintKind)})") from None
        if not isinstance(self.kind, ConstraintKind):
            raise ValueError(f"{name}: kind must be a ConstraintKind, got {type(self.kind).__name__}")
        field_name = f"{name}.{self.kind.value}"
        if not isinstance(self.spec, str):
            raise ValueError(f"{field_name}: must be a string, got {type(self.spec).__name__}")
        if isinstance(self.choices, (str, bytes)) or not isinstance(self.choices, (list, tuple)):
            raise ValueError(f"{name}.choice: must be a list of strings")
        object.__setattr__(self, "choices", tuple(self.choices))
        size = self.size_bytes
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"{field_name}: {size} bytes, more than {MAX_SPEC_BYTES}")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            object.__setattr__(self, "spec", _canonical_schema(self.spec, field_name))
        elif self.kind is ConstraintKind.CHOICE:
            if self.spec:
                raise ValueError(f"{field_name}: the strings go in choices, not spec")
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise ValueError(f"{field_name}: must hold 1 to {MAX_CHOICES} strings, got {len(self.choices)}")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError(f"{field_name}: every choice must be a non-empty string")
        elif self.kind is ConstraintKind.JSON_OBJECT:
            if self.spec or self.choices:
                raise ValueError(f"{field_name}: takes no schema (use json_schema)")
        else:
            if not self.spec.strip():
                raise ValueError(f"{field_name}: must not be empty")
        if self.kind is not ConstraintKind.CHOICE and self.choices:
            raise ValueError(f"{field_name}: takes no choices")

    @classmethod
    def json_schema(cls, schema: object) -> StructuredOutputs:
        """From a schema as a dict (or its JSON text)."""
        return cls(ConstraintKind.JSON_SCHEMA, schema if isinstance(schema, str) else _dumps(schema))

    @property
    def size_bytes(self) -> int:
        """What a size limit counts: the spec's UTF-8 bytes and the choices'."""
        return len(self.spec.encode()) + sum(len(c.encode()) for c in self.choices if isinstance(c, str))

    @property
    def key(self) -> str:
        """A digest of the constraint (the compile cache's key, with the tokenizer's)."""
        data = json.dumps([self.kind.value, self.spec, list(self.choices)], ensure_ascii=False)
        return hashlib.sha256(data.encode()).hexdigest()

    def nesting_depth(self) -> int:
        """How deeply the JSON schema nests (objects and arrays); 0 for other kinds."""
        if self.kind is not ConstraintKind.JSON_SCHEMA:
            return 0
        return json_depth(self.spec)


def _dumps(value: object) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"structured_outputs.json_schema: not JSON ({type(exc).__name__}: {exc})") from None


def _canonical_schema(text: str, field_name: str) -> str:
    depth = json_depth(text)  # before json.loads, whose recursion a deep text exhausts
    if depth > MAX_NESTING:
        raise ValueError(f"{field_name}: nested {depth} deep, more than {MAX_NESTING}")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{field_name}: not valid JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field_name}: a schema is a JSON object (or true / false), got {type(schema).__name__}")
    return _dumps(schema)


def bracket_depths(text: str) -> Iterator[tuple[int, int]]:
    """(index, depth after it) of each JSON bracket of `text` outside strings: a scan, no
    parse and no recursion (a hostile text of a million '[' is counted, not recursed into)."""
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            yield i, depth
        elif ch in "]}":
            depth -= 1
            yield i, depth


def json_depth(text: str) -> int:
    """How deeply JSON text nests (objects and arrays)."""
    return max((depth for _, depth in bracket_depths(text)), default=0)

"""A seeded generator of JSON schemas whose every instance is short, so that constrained
generation always ends within a test's max_tokens: strings have a maxLength or a
bounded pattern, integers bounds, arrays maxItems, objects at most three properties,
and recursion through $defs goes a bounded number of levels deep."""

from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]

PATTERNS = ("^[a-z]{1,5}$", "^[A-Z][a-z]{0,3}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$")
NAMES = ("id", "name", "tags", "size", "ok", "kind", "next", "value", "items", "meta")


def leaf(rng: random.Random) -> Schema:
    pick = rng.randrange(8)
    if pick == 0:
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if pick == 1:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if pick == 2:
        return {"enum": rng.sample(["a", "b", "xyz", 1, 2, True, None], rng.randint(1, 4))}
    if pick == 3:
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if pick == 4:
        return {"type": "boolean"}
    if pick == 5:
        return {"type": "null"}
    if pick == 6:
        return {"const": rng.choice(["fixed", 7, False])}
    return {"type": "string", "enum": ["alpha", "beta", "gamma"]}


def node(rng: random.Random, depth: int) -> Schema:
    if depth <= 0 or rng.random() < 0.35:
        return leaf(rng)
    pick = rng.randrange(3)
    if pick == 0:
        return obj(rng, depth - 1, rng.randint(1, 3))
    if pick == 1:
        low = rng.randint(0, 1)
        return {"type": "array", "items": node(rng, depth - 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return {"anyOf": [node(rng, depth - 1), leaf(rng)]}


def obj(rng: random.Random, depth: int, size: int) -> Schema:
    names = rng.sample(NAMES, size)
    props = {name: node(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    schema: Schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def with_defs(rng: random.Random, levels: int) -> Schema:
    """Recursion through $defs, bounded: level i refers to level i + 1, the last is a leaf."""
    defs: dict[str, Schema] = {}
    for i in range(levels):
        child: Schema = {"$ref": f"#/$defs/L{i + 1}"} if i + 1 < levels else leaf(rng)
        defs[f"L{i}"] = {"type": "object", "properties": {"v": leaf(rng), "child": child},
                         "required": ["v"] + (["child"] if rng.random() < 0.5 else []), "additionalProperties": False}
    return {"$defs": defs, "$ref": "#/$defs/L0"}


def schema(seed: int) -> Schema:
    rng = random.Random(seed)
    if seed % 5 == 4:
        return with_defs(rng, rng.randint(2, 3))
    return obj(rng, 2, rng.randint(1, 3))


def schemas(count: int, start: int = 0) -> list[Schema]:
    return [schema(seed) for seed in range(start, start + count)]

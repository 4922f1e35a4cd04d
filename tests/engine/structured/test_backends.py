"""Each grammar backend against brute force: at every step of random walks through a
small language, the tokens its mask allows are those whose text keeps the output a
prefix of some string of the language (EOS exactly where it is complete): all of them
for xgrammar, a non-empty subset for llguidance (it also refuses non-canonical
tokenizations);
rollback and fork restore and copy a matcher's place; padding ids are never allowed."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pdserve.engine.structured.backend import allocate_bitmask, bitmask_to_bool, choice_regex
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs

from conftest import EOS, VOCAB_SIZE

CHOICES = ("yes", "no", "maybe", "no way", "a+b (c)?")
REGEX = r"(ab|cd)[xy]{1,2}"
REGEX_LANGUAGE = {a + "".join(t) for a in ("ab", "cd") for n in (1, 2) for t in itertools.product("xy", repeat=n)}
GRAMMARS = {  # the backend's own syntax, one language
    "xgrammar": 'root ::= ("ab" | "cd") ("x" | "yz") "!"?',
    "llguidance": 'start: ("ab" | "cd") ("x" | "yz") "!"?',
}
GRAMMAR_LANGUAGE = {a + b + c for a in ("ab", "cd") for b in ("x", "yz") for c in ("", "!")}


def allowed(matcher) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(bitmask_to_bool(bitmask, VOCAB_SIZE)[0]).flatten().tolist())


def brute_force(prefix: str, language: set[str], texts: list[str | None]) -> set[int]:
    ids = {i for i, t in enumerate(texts) if t and any(s.startswith(prefix + t) for s in language)}
    return ids | ({EOS} if prefix in language else set())


def walk(backend, constraint: StructuredOutputs, language: set[str], texts: list[str | None], seed: int) -> None:
    rng = random.Random(seed)
    matcher = backend.compile(constraint).matcher()
    prefix = ""
    while True:
        want = brute_force(prefix, language, texts)
        got = allowed(matcher)
        if matcher.is_terminated():  # llguidance: the grammar allows nothing more (EOS only)
            assert prefix in language and got <= {EOS}
            return
        assert got <= want, f"after {prefix!r}: not in the language: {sorted(got - want)[:8]}"
        assert (EOS in got) == (EOS in want), f"after {prefix!r}: EOS allowed {EOS in got}"
        if backend.name == "xgrammar":  # every token that keeps the output in the language
            assert got == want, f"after {prefix!r}: missing {sorted(want - got)[:8]}"
        else:  # llguidance also forbids non-canonical tokenizations ("y" "e" "s" where "es" is a token)
            assert got, f"after {prefix!r}: nothing allowed"
        token = rng.choice(sorted(got))
        assert matcher.accept_token(token)
        if token == EOS:
            assert matcher.is_terminated()
            return
        prefix += texts[token]


@pytest.mark.parametrize("seed", range(6))
def test_choice_mask_is_brute_force(backend, token_texts, seed):
    walk(backend, StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES), set(CHOICES), token_texts, seed)


@pytest.mark.parametrize("seed", range(6))
def test_regex_mask_is_brute_force(backend, token_texts, seed):
    walk(backend, StructuredOutputs(ConstraintKind.REGEX, REGEX), REGEX_LANGUAGE, token_texts, seed)


@pytest.mark.parametrize("seed", range(6))
def test_grammar_mask_is_brute_force(backend, token_texts, seed):
    walk(backend, StructuredOutputs(ConstraintKind.GRAMMAR, GRAMMARS[backend.name]), GRAMMAR_LANGUAGE, token_texts,
         seed)


def test_choice_regex_escapes_every_special_character():
    import re

    pattern = choice_regex(CHOICES + (".*", "[x]", "a|b", "\\"))
    assert re.fullmatch(pattern, "a+b (c)?") and re.fullmatch(pattern, ".*") and re.fullmatch(pattern, "\\")
    assert not re.fullmatch(pattern, "ab") and not re.fullmatch(pattern, "x")


def test_rollback_and_fork(backend, token_texts):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"]}
    matcher = backend.compile(StructuredOutputs.json_schema(schema)).matcher()
    start = allowed(matcher)
    text = '{"a":12,"b":"y"}'  # compact: both backends' JSON
    ids = [i for i, t in enumerate(token_texts) if t]
    path = []  # greedy longest-token tokenization under the matcher
    while "".join(token_texts[t] for t in path) != text:
        done = "".join(token_texts[t] for t in path)
        options = [i for i in ids if text.startswith(done + token_texts[i]) and i in allowed(matcher)]
        assert options, f"no token continues {done!r}"
        token = max(options, key=lambda i: len(token_texts[i]))
        assert matcher.accept_token(token)
        path.append(token)
    assert allowed(matcher) == {EOS} or matcher.is_terminated()
    fork = matcher.fork()
    matcher.rollback(len(path))
    assert allowed(matcher) == start  # back at the start
    assert fork.accept_token(EOS) or fork.is_terminated()  # the fork kept its place
    assert not matcher.accept_token(EOS)  # and the original is not complete
    for token in path[:2]:
        assert matcher.accept_token(token)
    matcher.rollback(1)
    assert matcher.accept_token(path[1])


def test_refused_token_leaves_the_matcher_usable(backend, token_texts):
    matcher = backend.compile(StructuredOutputs(ConstraintKind.CHOICE, choices=("yes", "no"))).matcher()
    before = allowed(matcher)
    bad = next(i for i, t in enumerate(token_texts) if t == "z")
    assert not matcher.accept_token(bad)
    assert allowed(matcher) == before


def test_padding_and_special_ids_are_never_allowed(backend):
    matcher = backend.compile(StructuredOutputs(ConstraintKind.JSON_OBJECT)).matcher()
    got = allowed(matcher)
    assert got and not got & set(range(4096, VOCAB_SIZE)) and not got & {0, 2}


@pytest.mark.parametrize("kind, spec", [
    (ConstraintKind.REGEX, "(a"),
    (ConstraintKind.REGEX, "[z-a]"),
    (ConstraintKind.GRAMMAR, "root ::= undefined_rule"),
    (ConstraintKind.GRAMMAR, "this is not a grammar ::= ::="),
])
def test_a_refused_constraint_is_a_value_error_naming_the_field(backend, kind, spec):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind.value}: {backend.name} refused it: \S"):
        backend.compile(StructuredOutputs(kind, spec))


def test_recursive_schema_compiles_and_stays_bounded_by_its_matcher(backend):
    """Recursion through $defs compiles; a schema whose recursion never ends compiles too
    (both engines build grammars lazily): its output can never complete, so such a
    request ends at max_tokens ("length"), never hangs."""
    tree = {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"},
                                                             "kids": {"type": "array", "maxItems": 2,
                                                                      "items": {"$ref": "#/$defs/n"}}},
                            "required": ["v"]}}, "$ref": "#/$defs/n"}
    backend.compile(StructuredOutputs.json_schema(tree)).matcher()
    endless = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
               "$ref": "#/$defs/n"}
    try:
        matcher = backend.compile(StructuredOutputs.json_schema(endless)).matcher()
    except ValueError as exc:  # refusing it is fine too
        assert str(exc).startswith("structured_outputs.json_schema: ")
        return
    assert EOS not in allowed(matcher)


def test_json_strings_never_take_a_raw_control_character(backend, token_texts):
    """JSON forbids unescaped control characters in strings (xgrammar 0.2.9 allowed them
    in strings with a maxLength: its matcher is masked with a static row for the JSON kinds)."""
    string = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    for i, constraint in enumerate((StructuredOutputs.json_schema(string),
                       StructuredOutputs.json_schema({"type": "object", "required": ["a"], "properties": {
                           "a": {"type": "string", "minLength": 1, "maxLength": 8}}}),
                       StructuredOutputs(ConstraintKind.JSON_OBJECT))):
        matcher = backend.compile(constraint).matcher()
        for text in ('{"a":"', "x"):
            for token in tokens_of(text, token_texts, matcher):
                assert matcher.accept_token(token)
        got = allowed(matcher)
        assert got and not [t for t in got if token_texts[t] and any(ord(ch) < 0x20 for ch in token_texts[t])]
        # escapes still are (but in xgrammar's bounded strings)
        assert i == 1 or any(token_texts[t] == "\\" for t in got)


def tokens_of(text: str, token_texts: list[str | None], matcher) -> list[int]:
    """`text` as single-character tokens the matcher allows (every character here is one)."""
    return [next(i for i, t in enumerate(token_texts) if t == ch) for ch in text]


@pytest.mark.parametrize("schema", [{"type": "nonsense"}, {"type": "integer", "minimum": "x"},
                                    {"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "(a"}])
def test_an_invalid_schema_is_refused_with_the_backends_reason(backend, schema):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.json_schema: {backend.name} refused it: \S"):
        backend.compile(StructuredOutputs.json_schema(schema))

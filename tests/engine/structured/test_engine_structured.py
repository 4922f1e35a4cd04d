"""Constrained decoding through the engine, end to end, on the embedded model and on a
random model of another family (Qwen2, the embedded model's tokenizer beside it): every
constrained output finishes with "stop" and parses and validates (jsonschema), for
both backends, greedy and seeded, n > 1; the mask leaves batch neighbours' tokens
alone; logprobs are the constrained distribution's; logit_bias; the prefill role and
a migration's resumed tokens go through the same matcher. (Under speculative decoding:
test_spec_structured.py.)"""

from __future__ import annotations

import json
import math
import re
import shutil

import jsonschema
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.errors import FailureKind
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs

from hf_models import build_model
from schemas import schemas

PROMPT = "Return the record as JSON:"
MAX_TOKENS = 256
CHOICES = ("yes", "no", "maybe")
GRAMMARS = {
    "xgrammar": 'root ::= "(" num (" + " num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}',
    "llguidance": 'start: "(" NUM (" + " NUM)~0..3 ")"\nNUM: /[1-9][0-9]{0,2}/',
}
GRAMMAR_LANGUAGE = r"\([1-9][0-9]{0,2}( \+ [1-9][0-9]{0,2}){0,3}\)"
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-4096")
    build_model(path, "qwen2", seed=5, vocab_size=4096, bos_token_id=0, eos_token_id=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{DEFAULT_MODEL}/{name}", path / name)
    return str(path)


@pytest.fixture(scope="module")
def llm(family_dir):
    """LLM per (model, backend), built once for the module."""
    built: dict[tuple[str, str], LLM] = {}

    def get(model: str, backend: str) -> LLM:
        key = (model, backend)
        if key not in built:
            built[key] = LLM(DEFAULT_MODEL if model == "tiny" else family_dir, num_blocks=1024,
                             structured_outputs_backend=backend)
        return built[key]

    yield get
    for engine in built.values():
        engine.engine.close()


def constrained(c: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(structured_outputs=c, **{"max_tokens": MAX_TOKENS, "temperature": 0.0, **kw})


def check_json(text: str, schema: dict) -> None:
    jsonschema.Draft202012Validator(schema).validate(json.loads(text))


# (model, backend, sampling, how many schemas): every combination of model and backend,
# greedy and seeded temperature 1 each on one of them.
RUNS = [("tiny", "xgrammar", "greedy", 50), ("tiny", "llguidance", "seeded", 50),
        ("family", "xgrammar", "seeded", 20), ("family", "llguidance", "greedy", 20)]


@pytest.mark.parametrize("model, backend, sampling, count", RUNS)
def test_json_schemas_validate(llm, model, backend, sampling, count):
    engine = llm(model, backend)
    cases = schemas(count)
    kw = {"temperature": 1.0} if sampling == "seeded" else {}
    params = [constrained(StructuredOutputs.json_schema(s), seed=i, **kw) for i, s in enumerate(cases)]
    outs = engine.generate([PROMPT] * len(cases), params)
    for schema, out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text, out.error)
        check_json(c.text, schema)
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_n_samples_each_follow_their_own_matcher(llm, backend):
    engine = llm("tiny", backend)
    cases = schemas(6, start=100)
    params = [constrained(StructuredOutputs.json_schema(s), n=3, temperature=1.0, seed=7) for s in cases]
    outs = engine.generate([PROMPT] * len(cases), params)
    texts = set()
    for schema, out in zip(cases, outs):
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text, out.error)
            check_json(c.text, schema)
            texts.add(c.text)
    assert len(texts) > len(cases)  # samples differ: each has its own place in its grammar
    engine.check_integrity()


@pytest.mark.parametrize("model", ["tiny", "family"])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_other_kinds(llm, model, backend):
    engine = llm(model, backend)
    kinds = [
        StructuredOutputs(ConstraintKind.JSON_OBJECT),
        StructuredOutputs(ConstraintKind.REGEX, REGEX),
        StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES),
        StructuredOutputs(ConstraintKind.GRAMMAR, GRAMMARS[backend]),
    ]
    params = [constrained(c) for c in kinds] + [constrained(c, temperature=1.0, seed=3) for c in kinds[1:]]
    # any JSON object may nest without end: steer a random model to close it (a real use of logit_bias)
    close = engine.tokenizer.encode("}", add_special_tokens=False)[0]
    params[0] = constrained(kinds[0], logit_bias={close: 5.0})
    outs = engine.generate([PROMPT] * len(params), params)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (p.structured_outputs, c.text, out.error)
        kind = p.structured_outputs.kind
        if kind is ConstraintKind.JSON_OBJECT:
            assert isinstance(json.loads(c.text), dict)
        elif kind is ConstraintKind.REGEX:
            assert re.fullmatch(REGEX, c.text), c.text
        elif kind is ConstraintKind.CHOICE:
            assert c.text in CHOICES
        else:
            assert re.fullmatch(GRAMMAR_LANGUAGE, c.text), c.text


def test_an_unconstrained_neighbour_keeps_its_tokens(llm):
    engine = llm("tiny", "xgrammar")
    plain = [SamplingParams(max_tokens=32, temperature=0.0), SamplingParams(max_tokens=32, temperature=1.0, seed=11)]
    alone = [o.outputs[0].token_ids for o in engine.generate([PROMPT] * 2, plain)]
    batch = plain + [constrained(StructuredOutputs.json_schema(s)) for s in schemas(4)]
    batch += [constrained(StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES), temperature=1.0, seed=11)]
    together = engine.generate([PROMPT] * len(batch), batch)
    assert [o.outputs[0].token_ids for o in together[:2]] == alone


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_logprobs_are_the_constrained_distributions(llm, backend):
    engine = llm("tiny", backend)
    tok = engine.tokenizer
    out = engine.generate(PROMPT, constrained(StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES),
                                              logprobs=20, temperature=1.0, seed=1))[0].outputs[0]
    assert out.text in CHOICES
    done = ""
    for token, top in zip(out.token_ids, out.logprobs):
        finite = {t: lp for t, lp in top.items() if lp > float("-inf")}
        allowed = [t for t in finite if any(c.startswith(done + tok.token_text(t)) for c in CHOICES)
                   or (t == 1 and done in CHOICES)]
        assert sorted(allowed) == sorted(finite), (done, {tok.token_text(t): lp for t, lp in finite.items()})
        assert sum(math.exp(lp) for lp in finite.values()) == pytest.approx(1.0, abs=1e-4)
        done += tok.token_text(token) if token != 1 else ""


def test_logit_bias(llm):
    engine = llm("tiny", "xgrammar")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    base = engine.generate(PROMPT, greedy)[0].outputs[0]
    first = base.token_ids[0]
    banned = engine.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logit_bias={first: -100}))[0]
    assert first not in banned.outputs[0].token_ids
    favoured = 1234
    forced = engine.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0,
                                                    logit_bias={favoured: 100}))[0].outputs[0]
    assert forced.token_ids == [favoured] * 6
    assert forced.logprobs[0][favoured] < -1.0  # the reported logprob is the model's, unbiased
    no = engine.tokenizer.encode("no", add_special_tokens=False)
    assert len(no) == 1
    choice = StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES)
    steered = engine.generate(PROMPT, constrained(choice, logit_bias={no[0]: 100}))[0].outputs[0]
    assert steered.text == "no"
    # a bias cannot take a token past the grammar: +100 on a token the grammar forbids
    unsteered = engine.generate(PROMPT, constrained(choice, logit_bias={favoured: 100}))[0].outputs[0]
    assert unsteered.text in CHOICES and unsteered.finish_reason == "stop"


def test_resumed_tokens_enter_the_matcher(llm):
    """A migrated stream: the prompt ends with the sequence's own earlier output; the
    continuation is what the first worker would have produced, and still valid."""
    engine = llm("tiny", "xgrammar")
    schema = schemas(1, start=7)[0]
    c = StructuredOutputs.json_schema(schema)
    prompt = engine.tokenizer.encode(PROMPT)
    full = engine.generate([prompt], constrained(c))[0].outputs[0]
    assert len(full.token_ids) > 4
    k = len(full.token_ids) // 2
    rest = engine.generate([prompt + full.token_ids[:k]], constrained(c, resumed_tokens=k))[0].outputs[0]
    assert full.token_ids[:k] + rest.token_ids == full.token_ids and rest.finish_reason == "stop"
    off_grammar = engine.tokenizer.encode("zzz", add_special_tokens=False)
    bad = engine.generate([prompt + off_grammar], constrained(c, resumed_tokens=len(off_grammar)))[0]
    assert bad.failure is not None and bad.failure.value == "invalid_constraint"
    assert bad.error.startswith("resumed_tokens: token 0")


def test_prefill_role_samples_the_first_token_under_the_constraint(family_dir):
    """P/D in one process: the prefill engine samples the first token with the mask, the
    decode engine's matcher starts after it; the output is the colocated one."""
    prefill, decode = (LLMEngine(EngineConfig(model=family_dir, cache=CacheConfig(num_blocks=128))) for _ in range(2))
    schema = schemas(1, start=3)[0]
    params = constrained(StructuredOutputs.json_schema(schema), max_tokens=MAX_TOKENS)
    prompt = prefill.tokenizer.encode(PROMPT)
    colocated = LLM(family_dir, num_blocks=128).generate([prompt], params)[0].outputs[0]

    reservation = decode.reserve_remote("r", prompt, params)

    def on_layer(layer, slices):
        for s in slices:
            for i in range(s.start // 16, -(-s.end // 16)):
                decode.runner.kv_cache[layer, reservation.block_ids[i]] = prefill.runner.kv_cache[layer, s.block_ids[i]]

    prefill.layer_hook = on_layer
    prefill.add_request("r", prompt, constrained(params.structured_outputs, max_tokens=1), export_kv=True)
    firsts = []
    while prefill.has_unfinished():
        firsts += [o.outputs[0].token_ids for o in prefill.step()]
    first = firsts[0][0]
    prefill.release("r")
    assert first == colocated.token_ids[0]
    outs = decode.commit_remote("r", first)
    while decode.has_unfinished():
        outs += decode.step()
    out = outs[0].outputs[0]
    assert out.token_ids == colocated.token_ids and out.finish_reason == "stop"
    check_json(out.text, schema)
    for e in (prefill, decode):
        e.check_integrity()
        assert e.stats().num_free_blocks == e.stats().num_blocks


def test_stats_count_kinds_and_cache_hits(llm):
    engine = llm("family", "xgrammar")
    before = engine.stats().structured_outputs
    choice = constrained(StructuredOutputs(ConstraintKind.CHOICE, choices=("on", "off")))
    engine.generate([PROMPT] * 3, [choice] * 3)
    after = engine.stats().structured_outputs
    assert dict(after.requests)["choice"] == dict(before.requests).get("choice", 0) + 3
    assert after.cache_hits >= before.cache_hits + 2
    assert after.num_compiles <= before.num_compiles + 1 and after.compile_seconds_total >= before.compile_seconds_total


def test_min_tokens_yields_to_a_complete_grammar(llm):
    engine = llm("tiny", "xgrammar")
    out = engine.generate(PROMPT, constrained(StructuredOutputs(ConstraintKind.CHOICE, choices=("a", "b")),
                                              min_tokens=5))[0]
    assert out.error is None and out.outputs[0].text in ("a", "b") and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_schema_that_never_ends_fails_or_runs_to_max_tokens_alone(llm, backend):
    """xgrammar follows it to max_tokens ("length"); llguidance gives up on its first
    token (a parser limit): INVALID_CONSTRAINT with its reason. Either way, alone."""
    engine = llm("tiny", backend)
    endless = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
               "$ref": "#/$defs/n"}
    choice = constrained(StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES))
    outs = engine.generate([PROMPT] * 2, [constrained(StructuredOutputs.json_schema(endless), max_tokens=24), choice])
    if backend == "xgrammar":
        assert outs[0].error is None and outs[0].outputs[0].finish_reason == "length"
        assert outs[0].outputs[0].text.startswith('{"next":{"next":')
    else:
        assert outs[0].failure is FailureKind.INVALID_CONSTRAINT
        assert outs[0].error.startswith("structured_outputs: llguidance gave up on the grammar: ")
    assert outs[1].error is None and outs[1].outputs[0].text in CHOICES
    engine.check_integrity()

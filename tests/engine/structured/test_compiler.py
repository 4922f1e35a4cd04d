"""The compiler: its cache (hits, LRU bound, shared in-flight compiles), the admission
limits, and the deadline: a slow compile fails its own request while the engine keeps
stepping the others."""

from __future__ import annotations

import json

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.errors import FailureKind
from pdserve.engine.structured.build import make_backend
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs

# ~1 s for xgrammar on the embedded model's vocabulary (ten bounded alternatives)
SLOW_REGEX = "|".join(f"[a-z]{{{i},{i + 300}}}q{i}" for i in range(10))


def compiler(vocab, cache_size: int = 8, max_bytes: int = 1024, max_depth: int = 4) -> GrammarCompiler:
    return GrammarCompiler(lambda: make_backend("xgrammar", vocab), "xgrammar", vocab.fingerprint, timeout=5.0,
                           max_bytes=max_bytes, max_depth=max_depth, cache_size=cache_size)


def regex(text: str) -> StructuredOutputs:
    return StructuredOutputs(ConstraintKind.REGEX, text)


def test_equal_constraints_compile_once(vocab):
    c = compiler(vocab)
    first = c.submit(regex("[ab]+"))
    again = c.submit(regex("[ab]+"))  # while the first may still be compiling: the same future
    assert again.future is first.future
    first.future.result(timeout=10)
    c.submit(StructuredOutputs(ConstraintKind.CHOICE, choices=("x", "y"))).future.result(timeout=10)
    stats = c.stats()
    assert (stats.num_compiles, stats.cache_hits) == (2, 1)
    assert dict(stats.requests) == {"regex": 2, "choice": 1}
    assert len(c.take_compile_times()) == 2 and c.take_compile_times() == []
    c.close()


def test_the_cache_is_a_bounded_lru(vocab):
    c = compiler(vocab, cache_size=2)
    for text in ("a+", "b+", "a+", "c+"):  # a+ is used again, so b+ is the least recent
        c.submit(regex(text)).future.result(timeout=10)
    assert c.stats().cache_hits == 1
    c.submit(regex("a+"))
    assert c.stats().cache_hits == 2
    c.submit(regex("b+"))  # evicted: compiled again
    assert c.stats().cache_hits == 2 and c.stats().num_compiles <= 4
    c.close()


def test_a_refused_constraint_is_cached_as_refused(vocab):
    c = compiler(vocab)
    job = c.submit(regex("(a"))
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: xgrammar refused it"):
        job.future.result(timeout=10)
    assert c.submit(regex("(a")).future is job.future
    c.close()


def test_limits_are_refused_before_compiling(vocab):
    c = compiler(vocab, max_bytes=200, max_depth=3)
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: 201 bytes, more than "
                                         r"structured_outputs_max_bytes=200"):
        c.check(regex("a" * 201))
    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object"}}}}}
    with pytest.raises(ValueError, match=r"^structured_outputs\.json_schema: nested 5 deep, more than "
                                         r"structured_outputs_max_depth=3"):
        c.check(StructuredOutputs.json_schema(deep))
    c.check(regex("a" * 200))
    assert dict(c.stats().refusals) == {"too_large": 1, "too_deep": 1}
    assert c.stats().num_compiles == 0
    c.close()


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=128),
                               structured_outputs_compile_timeout=0.3, structured_outputs_max_bytes=4096))
    yield e
    e.close()


def run(e: LLMEngine, max_steps: int = 2000):
    outs = {}
    for _ in range(max_steps):
        if not e.has_unfinished():
            break
        for o in e.step():
            outs[o.request_id] = o
    assert not e.has_unfinished()
    e.check_integrity()
    return outs


def test_a_slow_compile_times_out_alone_while_others_step(engine):
    prompt = engine.tokenizer.encode("def add(a, b):")
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    engine.add_request("alone", prompt, plain)
    alone = run(engine)["alone"].outputs[0].token_ids

    engine.add_request("slow", prompt, SamplingParams(max_tokens=8, structured_outputs=regex(SLOW_REGEX)))
    engine.add_request("plain", prompt, plain)
    engine.add_request("fast", prompt, SamplingParams(max_tokens=8, structured_outputs=regex("(yes|no)")))
    steps_before = 0
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        steps_before += "slow" not in outs
    engine.check_integrity()
    slow = outs["slow"]
    assert slow.failure is FailureKind.CONSTRAINT_TIMEOUT and slow.outputs[0].finish_reason == "abort"
    assert "structured_outputs_compile_timeout=0.3" in slow.error
    assert outs["plain"].outputs[0].token_ids == alone  # stepped, untouched, while the grammar compiled
    assert outs["plain"].finished and outs["fast"].outputs[0].text in ("yes", "no")
    assert steps_before >= 2  # the engine stepped the others while the grammar compiled
    assert dict(engine.stats().structured_outputs.refusals)["timeout"] == 1


def test_a_refused_grammar_fails_its_request_alone(engine):
    prompt = engine.tokenizer.encode("x =")
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(ConstraintKind.GRAMMAR, "root ::= nope"))
    engine.add_request("bad", prompt, bad)
    engine.add_request("good", prompt, SamplingParams(max_tokens=4))
    outs = run(engine)
    assert outs["bad"].failure is FailureKind.INVALID_CONSTRAINT
    assert outs["bad"].error.startswith("structured_outputs.grammar: xgrammar refused it: ")
    assert outs["good"].error is None and len(outs["good"].outputs[0].token_ids) == 4


def test_admission_refuses_over_the_limits(engine):
    prompt = [5, 6, 7]
    huge = SamplingParams(structured_outputs=StructuredOutputs(ConstraintKind.REGEX, "a" * 5000))
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: 5000 bytes, more than "
                                         r"structured_outputs_max_bytes"):
        engine.add_request("huge", prompt, huge)
    deep_schema = json.dumps(json.loads("{" + '"a": {' * 40 + "}" * 40 + "}"))
    deep = SamplingParams(structured_outputs=StructuredOutputs(ConstraintKind.JSON_SCHEMA, deep_schema))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json_schema: nested 41 deep, more than "
                                         r"structured_outputs_max_depth=32"):
        engine.add_request("deep", prompt, deep)
    with pytest.raises(ValueError, match=r"^logit_bias: token ids must be < vocab_size 4096"):
        engine.add_request("bias", prompt, SamplingParams(logit_bias={4096: 1.0}))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field, value", [("structured_outputs_backend", "outlines"),
                                          ("structured_outputs_compile_timeout", -1.0),
                                          ("structured_outputs_max_bytes", 2 << 20),
                                          ("structured_outputs_max_depth", 0)])
def test_engine_config_refuses_bad_settings_by_name(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        EngineConfig(model=DEFAULT_MODEL, **{field: value})

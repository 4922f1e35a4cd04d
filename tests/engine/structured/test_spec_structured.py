"""Constrained decoding under speculative decoding (ngram, draft model, EAGLE-3) on the
embedded model: constrained sequences draft, their drafts are scored, and the output
is spec-off's token for token (greedy and seeded, both backends); every output
validates (unseeded too); unconstrained neighbours in the batch keep their tokens; a
decode engine speculates after a prefill engine's first token. And the masks of a
verification's rows, one grammar position each, with a draft the grammar refuses."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine_helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_DRAFT_MODEL, DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.structured.backend import allocate_bitmask, bitmask_to_bool
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.manager import StructuredOutputsManager
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs

from schemas import schemas

PROMPT = "Return the record as JSON:"
K = 3
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "measure_payoff": False},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": K, "model": DEFAULT_DRAFT_MODEL,
                    "measure_payoff": False},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": K, "model": DEFAULT_EAGLE3_HEAD,
               "measure_payoff": False},
}
# Schemas (of schemas.py's generator) whose outputs on the embedded model repeat
# themselves enough for the n-gram proposer to draft, and one short one.
SCHEMAS = [schemas(1, start=i)[0] for i in (20, 23, 24, 26, 37)]
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ("yes", "no", "maybe")


@pytest.fixture(scope="module")
def engines():
    """LLM per (backend, method or None: spec off), built once for the module."""
    built: dict[tuple[str, str | None], LLM] = {}

    def get(backend: str, method: str | None = None) -> LLM:
        key = (backend, method)
        if key not in built:
            built[key] = LLM(DEFAULT_MODEL, num_blocks=256, structured_outputs_backend=backend,
                             speculative_config=METHODS[method] if method else None)
        return built[key]

    yield get
    for llm in built.values():
        llm.engine.close()


def constrained(c: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(structured_outputs=c, **{"max_tokens": 160, "temperature": 0.0, **kw})


def batch(seeded: bool) -> list[SamplingParams]:
    """The schemas, a regex and a choice, greedy or seeded (temperature 1), and two
    unconstrained neighbours (greedy and seeded) last."""
    kw = {"temperature": 1.0} if seeded else {}
    params = [constrained(StructuredOutputs.json_schema(s), seed=i, **kw) for i, s in enumerate(SCHEMAS)]
    params += [constrained(StructuredOutputs(ConstraintKind.REGEX, REGEX), seed=5, **kw),
               constrained(StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES), seed=6, **kw)]
    return params + [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                     SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)]


def check_valid(params: SamplingParams, text: str) -> None:
    c = params.structured_outputs
    if c.kind is ConstraintKind.JSON_SCHEMA:
        jsonschema.Draft202012Validator(json.loads(c.spec)).validate(json.loads(text))
    elif c.kind is ConstraintKind.REGEX:
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def run_both(engines, backend: str, method: str, params: list[SamplingParams]) -> list:
    """The batch spec on, checked against spec off: same tokens, every constrained output
    valid and complete, drafts scored for the constrained sequences."""
    prompts = [PROMPT] * len(params)
    off = engines(backend).generate(prompts, params)
    spec = engines(backend, method)
    on = spec.generate(prompts, params)
    for p, a, b in zip(params, off, on):
        assert b.error is None, b.error
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, (p.structured_outputs, a.outputs[0].text,
                                                                  b.outputs[0].text)
        if p.structured_outputs is not None:
            assert b.outputs[0].finish_reason == "stop", b.outputs[0].text
            check_valid(p, b.outputs[0].text)
    drafted = [b for p, b in zip(params, on) if p.structured_outputs is not None]
    assert sum(b.num_draft_tokens for b in drafted) > 0 and sum(b.num_accepted_tokens for b in drafted) > 0
    spec.check_integrity()
    stats = spec.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.spec_decode.num_unspeculated_requests == 0
    return on


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_ngram_drafts_are_verified_under_the_grammar(engines, backend, seeded):
    run_both(engines, backend, "ngram", batch(seeded))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_n_samples_speculate_each_with_its_own_matcher(engines, backend):
    params = [constrained(StructuredOutputs.json_schema(s), n=2, temperature=1.0, seed=3) for s in SCHEMAS[1:3]]
    on = run_both(engines, backend, "ngram", params)
    assert all(len(out.outputs) == 2 for out in on)


@pytest.mark.parametrize("method, backend, seeded", [("draft_model", "xgrammar", False),
                                                     ("draft_model", "llguidance", True),
                                                     ("eagle3", "xgrammar", True),
                                                     ("eagle3", "llguidance", False)])
def test_model_drafts_are_verified_under_the_grammar(engines, method, backend, seeded):
    run_both(engines, backend, method, batch(seeded))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_verifications_rows_take_the_mask_at_their_own_positions(engines, backend):
    """Drafts 'y' 'es' <EOS-or-junk>: row 0 is the start's mask, row 1 after 'y', row 2
    after 'yes'; a refused draft ends the walk (its row forbids it, later rows are left
    alone); the matcher is back where it was; valid_drafts counts what the grammar takes."""
    llm = engines(backend)
    tok = llm.tokenizer
    manager: StructuredOutputsManager = llm.engine.structured
    compiler: GrammarCompiler = manager.compiler
    choice = StructuredOutputs(ConstraintKind.CHOICE, choices=CHOICES)
    grammar = compiler.submit(choice).future.result(timeout=30)
    y, es = tok.encode("yes", add_special_tokens=False)
    ma = tok.encode("maybe", add_special_tokens=False)[0]
    assert tok.token_text(y) == "y" and tok.token_text(es) == "es"
    junk = tok.encode("zzz", add_special_tokens=False)[0]
    vocab = manager.vocab_size

    def rows_after(prefix: list[int]) -> torch.Tensor:
        m = grammar.matcher()
        for t in prefix:
            assert m.accept_token(t)
        bitmask = allocate_bitmask(1, vocab)
        m.fill_bitmask(bitmask, 0)
        return bitmask_to_bool(bitmask, vocab)[0]

    manager.start("g", choice)
    manager.wait(30)
    assert manager.take_if_compiled("g")
    manager.attach("g", "s", [])
    try:
        assert manager.valid_drafts("s", [y, es, junk]) == 2
        assert manager.valid_drafts("s", [y, junk, es]) == 1
        assert manager.valid_drafts("s", [junk, y]) == 0
        logits = torch.zeros(1 + 4, vocab)  # row 0: another sequence's; rows 1..4: the verification
        manager.mask(logits, [(1, "s", [y, junk, es])])
        allowed = torch.isfinite(logits)
        assert allowed[0].all()
        assert torch.equal(allowed[1], rows_after([])) and allowed[1, y] and allowed[1, ma]
        assert torch.equal(allowed[2], rows_after([y])) and not allowed[2, junk]
        assert allowed[3:].all()  # after the refused draft: never used, left alone
        # the matcher is where it was: at the start
        check = torch.zeros(1, vocab)
        manager.mask(check, [(0, "s", ())])
        assert torch.equal(torch.isfinite(check[0]), rows_after([]))
        assert not manager.accept("s", y) and manager.valid_drafts("s", [es, junk]) == 1
    finally:
        manager.release("s")
        manager.forget_group("g")


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_unseeded_sampling_under_speculation_stays_valid(engines, backend):
    """Unseeded rows are not reproducible, but every output still satisfies its grammar."""
    params = [p for p in batch(seeded=True) if p.structured_outputs is not None]
    params = [constrained(p.structured_outputs, temperature=1.0) for p in params]
    spec = engines(backend, "ngram")
    outs = spec.generate([PROMPT] * len(params), params)
    for p, out in zip(params, outs):
        assert out.error is None and out.outputs[0].finish_reason == "stop", (out.error, out.outputs[0].text)
        check_valid(p, out.outputs[0].text)
    spec.check_integrity()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_decode_role_speculates_after_the_prefill_roles_first_token(engines, backend):
    """P/D in one process: the prefill engine (no speculation) samples the first token
    under the constraint; the decode engine drafts from its matcher's place after it.
    The output is the colocated spec-off one, and drafts were scored."""
    cache = CacheConfig(num_blocks=128)
    prefill = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=cache, structured_outputs_backend=backend))
    decode = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=cache, structured_outputs_backend=backend,
                                    speculative=METHODS["ngram"]))
    params = constrained(StructuredOutputs.json_schema(SCHEMAS[1]))
    prompt = prefill.tokenizer.encode(PROMPT)
    colocated = engines(backend).generate([prompt], params)[0].outputs[0]
    try:
        reservation = decode.reserve_remote("r", prompt, params)

        def on_layer(layer, slices):
            for s in slices:
                for i in range(s.start // 16, -(-s.end // 16)):
                    decode.runner.kv_cache[layer, reservation.block_ids[i]] = \
                        prefill.runner.kv_cache[layer, s.block_ids[i]]

        prefill.layer_hook = on_layer
        prefill.add_request("r", prompt, constrained(params.structured_outputs, max_tokens=1), export_kv=True)
        firsts = []
        while prefill.has_unfinished():
            firsts += [o.outputs[0].token_ids for o in prefill.step()]
        prefill.release("r")
        outs = decode.commit_remote("r", firsts[0][0])
        while decode.has_unfinished():
            outs += decode.step()
        assert outs[0].outputs[0].token_ids == colocated.token_ids
        assert outs[0].outputs[0].finish_reason == "stop" and outs[0].num_draft_tokens > 0
        check_valid(params, outs[0].outputs[0].text)
        for e in (prefill, decode):
            e.check_integrity()
            assert e.stats().num_free_blocks == e.stats().num_blocks
    finally:
        prefill.close()
        decode.close()

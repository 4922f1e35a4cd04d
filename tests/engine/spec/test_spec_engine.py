"""Speculative decoding through the engine: lossless against spec-off and transformers,
stops inside accepted runs, the prefix cache and KV events, metrics' invariants."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine_helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from hf_models import build_model, hf_greedy
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.hashing import ROOT_HASH, block_extra_keys, hash_block
from pdserve.engine.output import TokenDelta

K = 4
MAX_NEW = 24
ARCHS = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral-sliding": ("mistral", dict(sliding_window=40)),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def draft_config(model: Path | str, k: int = K) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k, "model": str(model)}


def prompts(seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Repetitive prompts (the n-gram proposer finds its suffixes) and plain random ones."""
    rng = random.Random(seed)
    motif = [rng.randrange(3, vocab) for _ in range(6)]
    out = [motif * 5, [rng.randrange(3, vocab) for _ in range(40)] + motif * 3, [7] * 3]
    out += [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 19, 70)]
    return out


@pytest.fixture(scope="module", params=list(ARCHS))
def target(request, tmp_path_factory):
    arch, overrides = ARCHS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = build_model(path, arch, **overrides)
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts()]
    # A draft of the same family that mostly disagrees with the target: half its size.
    draft = tmp_path_factory.mktemp(request.param + "-draft")
    build_model(draft, arch, seed=1, num_hidden_layers=1, **overrides)
    return path, draft, expected


def run(llm: LLM, params: SamplingParams, ps: list[list[int]] | None = None) -> list:
    outs = llm.generate(ps or prompts(), params)
    llm.check_integrity()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return outs


def check_spec_stats(llm: LLM) -> None:
    spec = llm.stats().spec_decode
    per_pos = spec.num_accepted_tokens_per_pos
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert sum(per_pos) == spec.num_accepted_tokens
    assert spec.num_drafts <= spec.num_draft_tokens <= K * spec.num_drafts


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
def test_greedy_equals_spec_off_and_transformers(target, method):
    path, draft, expected = target
    config = {"ngram": NGRAM, "draft": draft_config(draft), "self-draft": draft_config(path)}[method]
    llm = LLM(model=str(path), speculative_config=config)
    outs = run(llm, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == want, f"prompt {i} diverged"
    spec = llm.stats().spec_decode
    assert spec.num_draft_tokens > 0
    assert sum(o.num_draft_tokens for o in outs) == spec.num_draft_tokens
    assert sum(o.num_accepted_tokens for o in outs) == spec.num_accepted_tokens
    check_spec_stats(llm)
    if method == "self-draft":  # the target drafting for itself: every draft is right
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    if method == "draft":
        assert spec.num_accepted_tokens < spec.num_draft_tokens  # rejections were exercised


@pytest.mark.parametrize("mode", [
    dict(num_blocks=14, max_num_batched_tokens=512),  # preemption while speculating
    dict(max_num_batched_tokens=64, long_prefill_token_threshold=16),  # chunked prompts
    dict(enable_prefix_caching=False),
])
def test_preemption_chunking_and_no_cache_keep_tokens(target, mode):
    path, draft, expected = target
    for config in (NGRAM, draft_config(draft)):
        llm = LLM(model=str(path), speculative_config=config, **mode)
        outs = run(llm, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        assert [o.outputs[0].token_ids for o in outs] == expected
        if "num_blocks" in mode:
            assert llm.stats().num_preemptions > 0


SAMPLED = [
    dict(temperature=0.9, seed=11),
    dict(temperature=1.3, top_k=20, top_p=0.9, seed=12, min_tokens=5),
    dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, seed=13, min_p=0.05),
    dict(temperature=1.0, seed=14, n=3, logprobs=3),
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Weights 25x the usual scale: peaked distributions, so sampled drafts get accepted."""
    path = tmp_path_factory.mktemp("llama-s")
    build_model(path, "llama", vocab_size=64, initializer_range=0.5)
    return path


@pytest.mark.parametrize("sampling", SAMPLED, ids=["temp", "topk-topp-min-tokens", "penalties-minp", "n3-logprobs"])
def test_seeded_sampling_is_the_same_with_speculation_on_and_off(llama, sampling):
    params = SamplingParams(max_tokens=MAX_NEW, **sampling)
    ps = prompts(vocab=64)
    off = LLM(model=str(llama)).generate(ps, params)
    for config in (NGRAM, draft_config(llama)):
        llm = LLM(model=str(llama), speculative_config=config)
        on = run(llm, params, ps)
        spec = llm.stats().spec_decode
        # penalties make the n-gram's repeats unlikely; the target drafting greedily for
        # itself still gets some accepted
        assert spec.num_draft_tokens > 0 and (config is NGRAM or spec.num_accepted_tokens > 0)
        for a, b in zip(off, on):
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)
                if x.logprobs is not None:
                    assert [set(d) for d in x.logprobs] == [set(d) for d in y.logprobs]


def test_unseeded_sampling_keeps_the_target_distribution(tmp_path):
    """Two-sample chi-square on the 2nd and 3rd tokens over 3000 unseeded requests each,
    spec off vs a draft model that disagrees with the target (every draft verified by a
    fresh uniform), fixed engine seeds: deterministic, and a wrong acceptance rule (say,
    accept every draft) fails it by far."""
    target, draft = tmp_path / "t", tmp_path / "d"
    build_model(target, "llama", vocab_size=8, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    build_model(draft, "llama", vocab_size=8, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, seed=5)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    prompt, draws = [3, 4, 5, 3, 4], 3000
    counts = {}
    for name, config in (("off", None), ("on", draft_config(draft, 2))):
        llm = LLM(model=str(target), speculative_config=config, seed=1 if config else 2, max_num_seqs=256)
        outs = llm.generate([prompt] * draws, params)
        counts[name] = torch.tensor([[o.outputs[0].token_ids[pos] for o in outs] for pos in (1, 2)])
        if config:
            spec = llm.stats().spec_decode
            assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for pos in range(2):
        a = torch.bincount(counts["off"][pos], minlength=8).double()
        b = torch.bincount(counts["on"][pos], minlength=8).double()
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        expected_a = (a + b) * a.sum() / (a.sum() + b.sum())
        expected_b = (a + b) * b.sum() / (a.sum() + b.sum())
        chi2 = float(((a - expected_a) ** 2 / expected_a).sum() + ((b - expected_b) ** 2 / expected_b).sum())
        # 99.9th percentile of chi-square with 7 degrees of freedom: 24.3
        assert chi2 < 24.3, f"position {pos + 1}: chi2 {chi2:.1f}"


# -- stops and lengths inside an accepted run -------------------------------------------


def stream(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[TokenDelta], object]:
    deltas: list[TokenDelta] = []
    llm.engine.token_hook = deltas.append
    try:
        (out,) = llm.generate([prompt], params)
    finally:
        llm.engine.token_hook = None
    llm.check_integrity()
    return deltas, out


def check_nothing_past(deltas: list[TokenDelta], out, want: list[int], reason: str) -> None:
    completion = out.outputs[0]
    assert completion.token_ids == want
    assert [d.token_id for d in deltas] == want
    assert completion.finish_reason == reason
    assert [d.finish_reason for d in deltas] == [None] * (len(want) - 1) + [reason]
    assert completion.logprobs is None or len(completion.logprobs) == len(want)
    assert out.num_accepted_tokens <= len(want) - 1


@pytest.mark.parametrize("max_tokens", range(1, K + 3))
def test_max_tokens_inside_an_accepted_run(llama, max_tokens):
    llm = LLM(model=str(llama), speculative_config=draft_config(llama))
    prompt = prompts(vocab=64)[0]
    full = LLM(model=str(llama)).generate([prompt], SamplingParams(max_tokens=K + 2, temperature=0, ignore_eos=True))
    want = full[0].outputs[0].token_ids[:max_tokens]
    deltas, out = stream(llm, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1))
    check_nothing_past(deltas, out, want, "length")
    # The first token comes from the prompt's pass; then one verification drafts exactly
    # what max_tokens leaves room for beside its own token (never a draft past it), all
    # accepted.
    spec = llm.stats().spec_decode
    assert spec.num_draft_tokens == spec.num_accepted_tokens == max(0, max_tokens - 2)


@pytest.fixture(scope="module")
def greedy_run(llama):
    """The spec-off greedy tokens of a repetitive prompt, with repeats removed from
    the candidates a stop can be placed on (so the stop falls where it is put)."""
    prompt = prompts(vocab=64)[0]
    llm = LLM(model=str(llama))
    tokens = llm.generate([prompt], SamplingParams(max_tokens=2 * K + 2, temperature=0, ignore_eos=True))[0]
    return prompt, tokens.outputs[0].token_ids


@pytest.mark.parametrize("at", range(1, 2 * K + 1))
def test_stop_token_inside_an_accepted_run(llama, greedy_run, at):
    prompt, tokens = greedy_run
    stop = tokens[at]
    first = tokens.index(stop)  # the run stops at the stop token's first occurrence
    llm = LLM(model=str(llama), speculative_config=draft_config(llama))
    deltas, out = stream(llm, prompt, SamplingParams(max_tokens=4 * K, temperature=0, stop_token_ids=(stop,)))
    check_nothing_past(deltas, out, tokens[: first + 1], "stop")


@pytest.mark.parametrize("at", range(1, K + 2))
def test_eos_inside_an_accepted_run(tmp_path, llama, greedy_run, at):
    prompt, tokens = greedy_run
    model = tmp_path / "eos"
    model.mkdir()
    for f in llama.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    eos = tokens[at]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model / name).read_text())
        cfg["eos_token_id"] = eos
        (model / name).write_text(json.dumps(cfg))
    first = tokens.index(eos)
    llm = LLM(model=str(model), speculative_config=draft_config(model))
    deltas, out = stream(llm, prompt, SamplingParams(max_tokens=4 * K, temperature=0))
    check_nothing_past(deltas, out, tokens[: first + 1], "stop")
    # With min_tokens past it, EOS is masked at every verified position as without speculation.
    off = LLM(model=str(model)).generate([prompt], SamplingParams(max_tokens=4 * K, temperature=0, min_tokens=first + 2))
    _, out = stream(llm, prompt, SamplingParams(max_tokens=4 * K, temperature=0, min_tokens=first + 2))
    assert out.outputs[0].token_ids == off[0].outputs[0].token_ids


def test_stop_string_inside_an_accepted_run():
    """The embedded model (it has a tokenizer) drafting for itself: the text is cut at the
    stop string, and no token after the one completing it is emitted."""
    llm = LLM(speculative_config=draft_config(DEFAULT_MODEL), num_blocks=64)
    prompt = "def add(a, b):\n    return a + b\n\n\ndef"
    plain = LLM(num_blocks=64)
    stop = plain.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text[8:11]
    off = plain.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    deltas, out = stream(llm, llm.tokenizer.encode(prompt), SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    completion = out.outputs[0]
    assert completion.text == off.outputs[0].text and stop not in completion.text
    assert completion.token_ids == off.outputs[0].token_ids
    assert [d.token_id for d in deltas] == completion.token_ids
    assert completion.finish_reason == "stop"


# -- KV: rollback, the prefix cache, KV events -------------------------------------------


def test_only_accepted_blocks_enter_the_prefix_cache(target):
    """Every hash announced as stored is a block of a true sequence (prompt + emitted
    tokens), and its KV equals the spec-off engine's KV for the same block."""
    path, draft, _ = target
    params = SamplingParams(max_tokens=40, temperature=0.0)
    off = LLM(model=str(path), block_size=4)
    off_outs = run(off, params)
    for config in (NGRAM, draft_config(draft)):
        llm = LLM(model=str(path), block_size=4, speculative_config=config)
        stored: list[bytes] = []
        events = llm.engine.pool.events
        original = events.stored
        events.stored = lambda h: (stored.append(h), original(h))[1]  # a spy on the real log
        outs = run(llm, params)
        assert llm.stats().spec_decode.num_accepted_tokens < llm.stats().spec_decode.num_draft_tokens
        true_hashes = set()
        for out in outs:
            true_hashes |= set(chained_hashes(out.prompt_token_ids + out.outputs[0].token_ids, 4))
        assert stored and set(stored) <= true_hashes
        mine = {b.block_hash: b.block_id for b in llm.engine.pool.blocks if b.block_hash is not None}
        theirs = {b.block_hash: b.block_id for b in off.engine.pool.blocks if b.block_hash is not None}
        common = set(mine) & set(theirs)
        assert len(common) > len(off_outs)
        for h in common:
            torch.testing.assert_close(llm.engine.runner.kv_cache[:, mine[h]], off.engine.runner.kv_cache[:, theirs[h]],
                                       atol=1e-4, rtol=1e-4)


def chained_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], block_extra_keys(i, None))
        hashes.append(parent)
    return hashes


# -- what speculates -------------------------------------------------------------------


def test_beam_search_decodes_without_speculation(llama):
    params = SamplingParams(max_tokens=8, beam_width=3, n=2, temperature=0.0)
    ps = prompts(vocab=64)[:2]
    off = LLM(model=str(llama)).generate(ps, params)
    llm = LLM(model=str(llama), speculative_config=NGRAM)
    on = run(llm, params, ps)
    assert [[c.token_ids for c in o.outputs] for o in on] == [[c.token_ids for c in o.outputs] for o in off]
    spec = llm.stats().spec_decode
    assert spec.num_unspeculated_requests == 2 and spec.num_draft_tokens == 0


def test_disable_by_batch_size_turns_speculation_off(llama):
    ps = [prompts(vocab=64)[0]] * 4
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(model=str(llama), speculative_config={**NGRAM, "disable_by_batch_size": 4})
    run(llm, params, ps)
    assert llm.stats().spec_decode.num_draft_tokens == 0
    llm = LLM(model=str(llama), speculative_config={**NGRAM, "disable_by_batch_size": 5})
    run(llm, params, ps)
    assert llm.stats().spec_decode.num_draft_tokens > 0


def test_draft_model_must_share_the_vocabulary(tmp_path, llama):
    other = tmp_path / "other"
    build_model(other, "llama", vocab_size=65)
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft's vocab_size 65 differs"):
        LLM(model=str(llama), speculative_config=draft_config(other))
    with pytest.raises(ValueError, match=r"speculative_config.method: must be one of ngram, draft_model, eagle, eagle3"):
        LLM(model=str(llama), speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.model: is required for method eagle3"):
        LLM(model=str(llama), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


def test_draft_model_tokenizer_must_match(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    for f in Path(DEFAULT_MODEL).iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="speculative_config.model: the draft's tokenizer vocabulary differs"):
        LLM(speculative_config=draft_config(draft))


def test_a_failing_proposer_costs_drafts_never_requests(llama):
    """A fault in the proposer (every other call raises) leaves those steps without
    drafts; every request still gets spec-off's tokens."""
    ps = prompts(vocab=64)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    want = [o.outputs[0].token_ids for o in LLM(model=str(llama)).generate(ps, params)]
    llm = LLM(model=str(llama), speculative_config=draft_config(llama))
    proposer = llm.engine.speculator.proposer
    real, calls = proposer.propose, []

    def flaky(requests, ks):
        calls.append(len(requests))
        if len(calls) % 2:
            raise RuntimeError("draft device fault")
        return real(requests, ks)

    proposer.propose = flaky
    outs = run(llm, params, ps)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(calls) > 2 and llm.stats().spec_decode.num_draft_tokens > 0

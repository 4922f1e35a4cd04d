"""EAGLE across prefill and decode engines (engine/spec/draft_state.py), in one
process: the prefill engine runs the head over the prompt as it prefills, and the
decode engine that takes its state (with the prompt's KV pages) drafts exactly what
a local prefill would have drafted: the same tokens, the same acceptance counters.
The wire that carries the state between workers is tests/kvtransfer's; the cluster's
is tests/services/test_services_pd.py and tests/cluster/test_cluster_pd.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle_heads import build_eagle_head
from engine_helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from hf_models import build_model
from pdserve.engine import SamplingParams
from pdserve.engine.config import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL, CacheConfig, SchedulerConfig
from pdserve.engine.spec.draft_state import DraftState
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig

K = 4
KINDS = ("eagle", "eagle3")


def spec(head: Path | str, kind: str) -> SpeculativeConfig:
    return SpeculativeConfig.parse({"method": kind, "num_speculative_tokens": K, "model": str(head),
                                    "measure_payoff": False})


def engine(model: Path | str, head: Path | str | None, kind: str = "eagle3", chunk: int = 2048,
           num_blocks: int = 128) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model), cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, long_prefill_token_threshold=min(chunk, 2048)),
        speculative=spec(head, kind) if head is not None else None,
    ))


def run(e: LLMEngine, max_steps: int = 2000) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for _ in range(max_steps):
        if not e.has_unfinished():
            break
        for o in e.step():
            out[o.request_id] = [s.token_ids for s in o.outputs]
    assert not e.has_unfinished(), f"still running after {max_steps} steps"
    return out


def remote(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
           ship_draft: bool = True) -> list[list[int]]:
    """Prefill on one engine (pages copied as each layer writes them), decode on the other,
    with the prefill engine's DraftState unless `ship_draft` is False."""
    reservation = decode.reserve_remote(rid, prompt, params)
    skip = reservation.num_cached_tokens // 16

    def on_layer(layer, slices):
        for s in slices:
            for i in range(max(skip, s.start // 16), -(-s.end // 16)):
                decode.runner.kv_cache[layer, reservation.block_ids[i]] = prefill.runner.kv_cache[layer, s.block_ids[i]]

    prefill.layer_hook = on_layer
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=params.temperature, seed=params.seed),
                        export_kv=True)
    first = run(prefill)[rid][0][0]
    draft = prefill.held_draft(rid)
    assert draft is not None and draft.feature.shape == (decode.draft_layout.feature_size,)
    prefill.release(rid)
    assert prefill.held_draft(rid) is None  # released with the held blocks
    prefill.check_integrity()
    continues = params.n == 1 and not params.use_beam_search
    done = decode.commit_remote(rid, first if continues else None, draft if ship_draft else None)
    out = run(decode)
    for o in done:
        out[o.request_id] = [s.token_ids for s in o.outputs]
    return out[rid]


def local(e: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    e.add_request(rid, prompt, params)
    return run(e)[rid]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle-pd-target")
    build_model(path, "llama", num_hidden_layers=4, initializer_range=0.1)
    heads = {}
    for kind in KINDS:
        heads[kind] = tmp_path_factory.mktemp(f"eagle-pd-{kind}")
        build_eagle_head(heads[kind], path, kind, seed=3, draft_vocab=200 if kind == "eagle3" else None)
    return path, heads


PROMPTS = [[11, 23, 47, 95, 191] * 6, list(range(3, 60)), [5, 9, 17, 33, 65, 129, 200, 7, 11, 13, 50], [7, 8]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole", "chunked"])
def test_a_remotely_prefilled_prompt_drafts_as_a_local_one(family, kind, chunk):
    """Prompts one at a time (the same passes on both sides), greedy and seeded n = 2
    (forks copy the head's KV): tokens and every acceptance counter equal."""
    path, heads = family
    alone, prefill, decode = (engine(path, heads[kind], kind, chunk) for _ in range(3))
    for i, prompt in enumerate(PROMPTS):
        for j, params in enumerate([SamplingParams(max_tokens=20, temperature=0.0),
                                    SamplingParams(max_tokens=12, temperature=0.8, seed=i, n=2)]):
            rid = f"r{i}-{j}"
            assert remote(prefill, decode, rid, prompt, params) == local(alone, rid, prompt, params), rid
    assert decode.stats().spec_decode == alone.stats().spec_decode
    assert decode.stats().spec_decode.num_draft_tokens > 0
    for e in (alone, prefill, decode):
        e.check_integrity()
        assert e.stats().num_free_blocks == e.stats().num_blocks


CODE = ["def read_lines(path):\n    with open(path) as f:\n", "class Stack:\n    def __init__(self):\n",
        "import os\n\n\ndef walk(root):\n    for dirpath, dirnames, filenames in os.walk(root):\n"]


def test_the_trained_head_accepts_as_much_after_a_remote_prefill_and_less_without_its_state():
    """The embedded model and its committed EAGLE-3 head: the shipped state gives the
    local counters exactly; a decode engine that starts its head at the first decoded
    token (no state) accepts fewer drafts."""
    alone, prefill, decode, prefill2, bare = (engine(DEFAULT_MODEL, DEFAULT_EAGLE3_HEAD) for _ in range(5))
    tok = alone.tokenizer
    params = SamplingParams(max_tokens=32, temperature=0.0)
    for i, text in enumerate(CODE):
        prompt = tok.encode(text)
        want = local(alone, f"c{i}", prompt, params)
        assert remote(prefill, decode, f"c{i}", prompt, params) == want
        assert remote(prefill2, bare, f"c{i}", prompt, params, ship_draft=False) == want
    stats = alone.stats().spec_decode
    assert decode.stats().spec_decode == stats
    assert stats.num_accepted_tokens > bare.stats().spec_decode.num_accepted_tokens, (stats, bare.stats().spec_decode)


def test_a_state_that_does_not_fit_the_head_is_dropped_and_the_tokens_stay(family):
    """A peer's state is checked again on adoption (shape and dtype): one that does not
    fit is dropped (the head starts afresh), the request decodes as usual."""
    path, heads = family
    prefill, decode, alone = (engine(path, heads["eagle3"]) for _ in range(3))
    prompt, params = PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0)
    want = local(alone, "x", prompt, params)
    reservation = decode.reserve_remote("x", prompt, params)
    prefill.layer_hook = lambda layer, slices: [
        decode.runner.kv_cache[layer].__setitem__(reservation.block_ids[i], prefill.runner.kv_cache[layer, s.block_ids[i]])
        for s in slices for i in range(s.start // 16, -(-s.end // 16))]
    prefill.add_request("x", prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    first = run(prefill)["x"][0][0]
    draft = prefill.held_draft("x")
    prefill.release("x")
    bad = DraftState(draft.base, draft.kv[:-1], draft.feature)  # one row short
    with pytest.raises(ValueError, match="draft.kv"):
        bad.check(decode.draft_layout, len(prompt))
    with pytest.raises(ValueError, match="draft.feature"):
        DraftState(draft.base, draft.kv, draft.feature.to(torch.float16)).check(decode.draft_layout, len(prompt))
    done = decode.commit_remote("x", first, bad)
    assert run(decode)["x"] == want and not done
    decode.check_integrity()
    assert decode.stats().num_free_blocks == decode.stats().num_blocks


def test_workers_with_different_heads_do_not_share_a_kv_layout(family, tmp_path):
    path, heads = family
    other = tmp_path / "other"
    build_eagle_head(other, path, "eagle3", seed=4, draft_vocab=200)
    layouts = {engine(path, h).kv_layout for h in (heads["eagle3"], other, None)}
    assert len(layouts) == 3 and all(not l.endswith("eagle_head=") for l in layouts)
    assert engine(path, heads["eagle3"]).kv_layout == engine(path, heads["eagle3"]).kv_layout

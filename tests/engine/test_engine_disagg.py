"""The engine's disaggregation contract, in one process with no network: a prefill
engine exports a prompt's KV layer by layer, a decode engine reserves blocks, takes
the pages and continues with exactly the tokens the prefill engine would produce."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine, NoCapacityError
from hf_models import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg")
    build_model(path, "qwen2", seed=11)
    return str(path)


def engine(model_dir: str, num_blocks: int = 128, chunk: int = 2048, spec: dict | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir, cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk), speculative=spec,
    ))


# Decode engines without and with speculation: received KV, a first token sampled
# elsewhere and n > 1's recomputed last prompt token change nothing for them.
SPECS = {
    "off": lambda model_dir: None,
    "ngram": lambda model_dir: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "self-draft": lambda model_dir: {"method": "draft_model", "num_speculative_tokens": 3, "model": model_dir},
}


def run(e: LLMEngine, max_steps: int = 1000) -> dict[str, list[int]]:
    out = {}
    for _ in range(max_steps):
        if not e.has_unfinished():
            break
        for o in e.step():
            out[o.request_id] = o.outputs[0].token_ids
    assert not e.has_unfinished(), f"still running after {max_steps} steps"
    return out


def transfer(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams, rid: str,
             sample_first: bool = True) -> dict[str, list[int]]:
    """Prefill on one engine, copy pages layer by layer as they are written, decode on the other."""
    reservation = decode.reserve_remote(rid, prompt, params)
    cached_blocks = reservation.num_cached_tokens // 16
    layers_seen: list[int] = []

    def on_layer(layer, slices):
        layers_seen.append(layer)
        for s in slices:
            for i in range(s.start // 16, -(-s.end // 16)):
                if i >= cached_blocks:
                    dst = reservation.block_ids[i]
                    decode.runner.kv_cache[layer, dst] = prefill.runner.kv_cache[layer, s.block_ids[i]]

    prefill.layer_hook = on_layer
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=params.temperature, seed=params.seed), export_kv=True)
    first = run(prefill)[rid][0]
    assert sorted(set(layers_seen)) == list(range(prefill.model_config.num_layers))
    assert prefill.stats().num_requests_held == 1
    prefill.release(rid)
    prefill.check_integrity()
    assert prefill.stats().num_free_blocks == prefill.stats().num_blocks
    done = decode.commit_remote(rid, first if sample_first else None)
    out = run(decode)
    for o in done:
        out[o.request_id] = o.outputs[0].token_ids
    return out


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("chunk", [2048, 24])
def test_decode_continues_exactly_from_received_kv(model_dir, chunk, spec):
    prompts = [[3 + (i * 13 + j) % 250 for j in range(n)] for i, n in enumerate((1, 16, 45, 130))]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    local = engine(model_dir)
    for i, p in enumerate(prompts):
        local.add_request(f"r{i}", p, params)
    expected = run(local)
    prefill, decode = engine(model_dir, chunk=chunk), engine(model_dir, spec=SPECS[spec](model_dir))
    for i, p in enumerate(prompts):
        assert transfer(prefill, decode, p, params, f"r{i}")[f"r{i}"] == expected[f"r{i}"]
    decode.check_integrity()
    assert decode.stats().num_free_blocks == decode.stats().num_blocks


def test_decode_side_prefix_hit_skips_blocks(model_dir):
    prefill, decode = engine(model_dir), engine(model_dir)
    prompt = [5 + i % 200 for i in range(70)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = transfer(prefill, decode, prompt, params, "a")["a"]
    reservation = decode.reserve_remote("b", prompt, params)
    assert reservation.num_cached_tokens == 64  # four full blocks already here
    decode.abort("b")
    assert transfer(prefill, decode, prompt, params, "c")["c"] == first
    decode.check_integrity()


@pytest.mark.parametrize("spec", list(SPECS))
def test_parallel_samples_recompute_the_last_token_on_decode(model_dir, spec):
    prefill, decode = engine(model_dir), engine(model_dir, spec=SPECS[spec](model_dir))
    prompt = [9 + i % 100 for i in range(33)]
    params = SamplingParams(max_tokens=6, temperature=0.0, n=3)
    local = engine(model_dir)
    local.add_request("x", prompt, params)
    expected = None
    while local.has_unfinished():
        for o in local.step():
            expected = [c.token_ids for c in o.outputs]
    out = transfer(prefill, decode, prompt, params, "z", sample_first=False)
    assert out["z"] == expected[0]
    if spec == "self-draft":
        assert decode.stats().spec_decode.num_accepted_tokens > 0
    decode.check_integrity()
    assert decode.stats().num_free_blocks == decode.stats().num_blocks


def test_reservation_fails_cleanly_when_full_and_aborts_free(model_dir):
    decode = engine(model_dir, num_blocks=4)
    with pytest.raises(NoCapacityError):
        decode.reserve_remote("big", list(range(3, 100)), SamplingParams(max_tokens=2))
    r = decode.reserve_remote("ok", list(range(3, 40)), SamplingParams(max_tokens=2))
    assert len(r.block_ids) == 3 and decode.stats().num_free_blocks == 1
    decode.abort("ok")
    decode.check_integrity()
    assert decode.stats().num_free_blocks == 4 and not decode.has_unfinished()
    with pytest.raises(ValueError, match="request_id"):
        decode.commit_remote("ok", 5)

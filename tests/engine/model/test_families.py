"""Every model family against transformers on the same random weights (fp32, built with
transformers' own config classes): greedy tokens equal, prompt logprobs within 1e-4,
through the engine and through a prefill engine handing its KV to a decode engine.

Shapes: GQA, MQA and MHA; tied and untied embeddings; sliding windows shorter than
the longer prompts; every RoPE type, yarn and longrope with prompts longer than
original_max_position_embeddings; Gemma's soft-capping set low enough to bite.

Longrope runs one set of factors per engine (engine/model/rope.py): sequences that
stay within original_max_position_embeddings are compared on an engine of that
max_model_len (short factors), longer ones on the default engine (long factors), and
a Phi-3 sequence that crosses it while decoding against transformers' recomputed cache.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from hf_models import build_model, hf_greedy
from triton_interpreter import skip_repatching

MAX_NEW = 16
ORIGINAL = 64  # original_max_position_embeddings of the yarn and longrope configs
PROMPT_LENGTHS = (1, 7, 33, 52, 100, 150)  # 52 + MAX_NEW crosses ORIGINAL while decoding


def _longrope(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    short = (1.0 + torch.rand(8, generator=gen)).tolist()  # head_dim 16: 8 factors each
    long = (1.0 + 4 * torch.rand(8, generator=gen)).tolist()
    return dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long)


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=ORIGINAL)
GEMMA_CAPS = dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
QK_GAIN = 16.0  # Gemma's q/k projections scaled up: scores of several units, which a cap of 5 bends

CONFIGS = {
    "qwen3-gqa-untied-headdim": ("qwen3", dict(head_dim=24)),
    # tied: initializer_range 0.1, else the random layers barely move the residual off
    # the input token's embedding and every prediction repeats it
    "qwen3-mqa-tied-yarn": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=YARN,
                                          initializer_range=0.1)),
    "qwen3-sliding-dynamic": ("qwen3", dict(use_sliding_window=True, sliding_window=40, max_window_layers=1,
                                            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "gemma2-gqa-softcap-sliding": ("gemma2", dict(sliding_window=32, **GEMMA_CAPS)),
    "gemma2-mqa-untied-linear": ("gemma2", dict(num_key_value_heads=1, tie_word_embeddings=False, sliding_window=24,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                                rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                     factor=2.0))),
    # Gemma 3 keeps attn_logit_softcapping out of attention (as transformers does): set, ignored
    "gemma3-local-global": ("gemma3", dict(sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                                           tie_word_embeddings=False, query_pre_attn_scalar=20, **GEMMA_CAPS,
                                           rope_parameters={
                                               "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                               "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=4.0),
                                           })),
    "gemma3-mqa-yarn": ("gemma3", dict(num_key_value_heads=1, sliding_window=24, num_hidden_layers=3,
                                       final_logit_softcapping=3.0, sliding_window_pattern=3, rope_parameters={
                                           "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                           "full_attention": dict(YARN, rope_theta=1e6),
                                       })),
    "phi3-gqa-longrope": ("phi3", dict(original_max_position_embeddings=ORIGINAL, rope_parameters=_longrope(0))),
    "phi3-mha-tied-sliding": ("phi3", dict(num_key_value_heads=4, tie_word_embeddings=True, sliding_window=40,
                                           initializer_range=0.1)),
    "llama-mqa-yarn": ("llama", dict(num_key_value_heads=1, rope_parameters=YARN)),
    "mistral-longrope": ("mistral", dict(
        head_dim=16, original_max_position_embeddings=ORIGINAL,
        rope_parameters=dict(_longrope(1), original_max_position_embeddings=ORIGINAL))),
}


def _gain(arch: str) -> float:
    return QK_GAIN if arch.startswith("gemma") else 1.0


def is_longrope(name: str) -> bool:
    rope = CONFIGS[name][1].get("rope_parameters") or {}
    return rope.get("rope_type") == "longrope"


def regimes(name: str, ps: list[list[int]]) -> list[tuple[dict, list[int]]]:
    """(LLM arguments, the prompts that engine is compared on): every prompt on the
    default engine, but for longrope the short sequences on an engine of max_model_len
    ORIGINAL and those longer than ORIGINAL on the default one."""
    if not is_longrope(name):
        return [({}, list(range(len(ps))))]
    short = [i for i, p in enumerate(ps) if len(p) + MAX_NEW <= ORIGINAL]
    return [(dict(max_model_len=ORIGINAL), short), ({}, long_prompts(ps))]


def long_prompts(ps: list[list[int]]) -> list[int]:
    return [i for i, p in enumerate(ps) if len(p) > ORIGINAL]


def prompts(vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, fp32."""
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return [float(logprobs[i - 1, t]) for i, t in enumerate(prompt) if i > 0]


def hf_generated_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' logprob of each greedy token, from its own decode steps' logits
    (not one forward over the whole text: longrope's factors differ between the two)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens), do_sample=False,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return [float(step[0].float().log_softmax(-1)[t]) for step, t in zip(out.logits, tokens)]


Reference = tuple[str, list[list[int]], list[list[int]], list[float], list[list[float]]]


def build_reference(name: str, path) -> Reference:
    """The model saved at `path`; its prompts, transformers' greedy tokens for each, the
    prompt logprobs of the last (longest) prompt and each greedy token's logprob."""
    arch, overrides = CONFIGS[name]
    model = build_model(path, arch, seed=3, qk_gain=_gain(arch), **overrides)
    ps = prompts()
    greedy = [hf_greedy(model, p, MAX_NEW, eos=False) for p in ps]
    generated = [hf_generated_logprobs(model, p, g) for p, g in zip(ps, greedy)]
    return str(path), ps, greedy, hf_prompt_logprobs(model, ps[-1]), generated


@pytest.fixture(scope="module")
def reference_by_name(tmp_path_factory):
    """build_reference, once per config name for the module."""
    built: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in built:
            built[name] = build_reference(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="module", params=list(CONFIGS))
def reference(request, reference_by_name):
    return request.param, reference_by_name(request.param)


def greedy_params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, **kw})


def test_greedy_and_logprobs_match_transformers(reference):
    """Tokens equal; the prompt's logprobs and every generated token's (the decode
    path's numerics) within 1e-4."""
    name, (path, ps, greedy, logprobs, generated) = reference
    last = len(ps) - 1
    for kwargs, chosen in regimes(name, ps):
        llm = LLM(model=path, **kwargs)
        params = [greedy_params(logprobs=1, prompt_logprobs=1 if i == last else None) for i in chosen]
        for i, out in zip(chosen, llm.generate([ps[i] for i in chosen], params)):
            assert out.outputs[0].token_ids == greedy[i], f"prompt {i} (len {len(ps[i])}) diverged"
            got = [entry[t] for entry, t in zip(out.outputs[0].logprobs, greedy[i])]
            assert max(abs(g - w) for g, w in zip(got, generated[i])) < 1e-4, f"prompt {i}"
            if i == last:
                got = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], ps[i][1:])]
                assert max(abs(g - e) for g, e in zip(got, logprobs)) < 1e-4
        llm.check_integrity()


def test_phi3_crossing_original_length_equals_transformers_recomputed_cache(reference_by_name):
    """transformers' Phi-3 generate recomputes its whole cache with the long factors
    when a sequence first exceeds original_max_position_embeddings; from there on its
    logits are the long-factor engine's for the same text."""
    path, ps, greedy, _, generated = reference_by_name("phi3-gqa-longrope")
    prompt, tokens = ps[3], greedy[3]
    cross = ORIGINAL + 1 - len(prompt)  # the first step whose input exceeds ORIGINAL
    assert 0 < cross < MAX_NEW
    out = LLM(model=path).generate([prompt + tokens[:cross]], greedy_params(max_tokens=MAX_NEW - cross, logprobs=1))
    assert out[0].outputs[0].token_ids == tokens[cross:]
    got = [entry[t] for entry, t in zip(out[0].outputs[0].logprobs, tokens[cross:])]
    assert max(abs(g - w) for g, w in zip(got, generated[3][cross:])) < 1e-4


def engine(path: str, num_blocks: int = 96) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, cache=CacheConfig(num_blocks=num_blocks)))


def run(e: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] = o.outputs[0].token_ids
    return out


def prefill_then_decode(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    """The prompt prefilled on one engine, its pages copied as each layer is written,
    the rest decoded on the other (tests/engine/test_engine_disagg.py has the contract)."""
    reservation = decode.reserve_remote(rid, prompt, greedy_params())
    skip = reservation.num_cached_tokens // prefill.runner.block_size

    def on_layer(layer, slices):
        size = prefill.runner.block_size
        for s in slices:
            for i in range(max(skip, s.start // size), -(-s.end // size)):
                decode.runner.kv_cache[layer, reservation.block_ids[i]] = prefill.runner.kv_cache[layer, s.block_ids[i]]

    prefill.layer_hook = on_layer
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    first = run(prefill)[rid][0]
    prefill.release(rid)
    out = {o.request_id: o.outputs[0].token_ids for o in decode.commit_remote(rid, first)}
    out.update(run(decode))
    return out[rid]


@pytest.mark.parametrize("name", ["gemma2-gqa-softcap-sliding", "gemma3-local-global", "phi3-gqa-longrope"])
def test_prefill_decode_engines_match_transformers(reference_by_name, name):
    path, ps, greedy = reference_by_name(name)[:3]
    prefill, decode = engine(path), engine(path)
    for i in long_prompts(ps) if is_longrope(name) else range(2, len(ps)):
        assert prefill_then_decode(prefill, decode, f"r{i}", ps[i]) == greedy[i]
    for e in (prefill, decode):
        e.check_integrity()
        assert e.stats().num_free_blocks == e.stats().num_blocks
    if is_longrope(name):  # a worker of the other set of factors is not a KV partner
        short = LLMEngine(EngineConfig(model=path, cache=CacheConfig(num_blocks=8),
                                       scheduler=SchedulerConfig(max_model_len=ORIGINAL)))
        assert "longrope=long" in prefill.runner.kv_layout and "longrope=short" in short.runner.kv_layout


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2-features")
    arch, overrides = CONFIGS["gemma2-gqa-softcap-sliding"]
    model = build_model(path, arch, seed=3, qk_gain=_gain(arch), **overrides)
    ps = prompts()
    shared = ps[-1][:120] + ps[3][:20]  # a long cached prefix, past the sliding window
    return str(path), [*ps, shared], [hf_greedy(model, p, MAX_NEW, eos=False) for p in [*ps, shared]]


def test_gemma_chunked_prefix_cached_preempted_and_parallel(gemma2):
    """Chunked prefill, prefix-cache hits past the sliding window, preemption and n > 1
    all keep transformers' tokens; beams run alongside and free everything."""
    path, ps, expected = gemma2
    llm = LLM(model=path, max_num_batched_tokens=64, long_prefill_token_threshold=24, num_blocks=40)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(ps, greedy_params(n=2))
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    beams = llm.generate(ps[2:4], SamplingParams(max_tokens=8, beam_width=3, n=2, ignore_eos=True))
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 8 for c in o.outputs) for o in beams)
    llm.check_integrity()
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


@pytest.mark.parametrize("name", ["gemma2-gqa-softcap-sliding", "gemma3-local-global"])
def test_gemma_on_triton_kernels_matches_transformers(reference_by_name, name):
    """Soft-capped attention (Gemma 2), per-head q/k norms and two RoPE bases (Gemma 3)
    and alternating windows through the Triton kernels (the interpreter on a CPU)."""
    path, ps, greedy, logprobs = reference_by_name(name)[:4]
    skip_repatching()  # on a CPU: the interpreter, without its redundant per-call work
    llm = LLM(model=path, attention_backend="triton", max_num_batched_tokens=64)
    params = [greedy_params(max_tokens=4) for _ in ps[:-1]] + [greedy_params(max_tokens=1, prompt_logprobs=1)]
    outs = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in outs] == [g[:4] for g in greedy[:-1]] + [greedy[-1][:1]]
    got = [entry[token] for entry, token in zip(outs[-1].prompt_logprobs[1:], ps[-1][1:])]
    assert max(abs(g - e) for g, e in zip(got, logprobs)) < 1e-4
    llm.check_integrity()


@pytest.mark.parametrize("name", ["qwen3-gqa-untied-headdim", "gemma2-gqa-softcap-sliding", "gemma3-local-global",
                                  "phi3-gqa-longrope"])
def test_bfloat16_agrees_with_transformers(tmp_path, name):
    """bfloat16 weights: the same first tokens and prompt logprobs within bf16 noise
    (Gemma's embedding scale and norms round as transformers rounds them)."""
    arch, overrides = CONFIGS[name]
    model = build_model(tmp_path, arch, seed=3, dtype=torch.bfloat16, qk_gain=_gain(arch), **overrides)
    ps = [p for p in prompts()[2:] if len(p) > ORIGINAL or not is_longrope(name)]
    outs = LLM(model=str(tmp_path), dtype="bfloat16").generate(ps, greedy_params(max_tokens=1, prompt_logprobs=1))
    for prompt, out in zip(ps, outs):
        with torch.no_grad():
            logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        top2 = logprobs[-1].topk(2).values
        if top2[0] - top2[1] > 0.05:  # a clear winner (bf16 rounding may break a near tie either way)
            assert out.outputs[0].token_ids == [int(logprobs[-1].argmax())]
        got = torch.tensor([entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        assert (got - logprobs[torch.arange(len(prompt) - 1), prompt[1:]]).abs().max() < 0.05


@pytest.mark.parametrize("name", ["qwen3-mqa-tied-yarn", "gemma2-gqa-softcap-sliding"])
def test_speculative_decoding_keeps_transformers_tokens(reference_by_name, name):
    """A draft model (the model itself) and ngram drafts: verification keeps the tokens."""
    path, ps, greedy = reference_by_name(name)[:3]
    for spec in ({"method": "draft_model", "num_speculative_tokens": 3, "model": path},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(model=path, speculative_config=spec)
        outs = llm.generate(ps, greedy_params())
        assert [o.outputs[0].token_ids for o in outs] == greedy
        assert llm.stats().spec_decode.num_accepted_tokens > 0
        llm.check_integrity()


@pytest.mark.parametrize("name", ["gemma2-gqa-softcap-sliding", "gemma3-local-global", "phi3-gqa-longrope",
                                  "qwen3-mqa-tied-yarn"])
def test_forward_runs_on_the_device(reference_by_name, name):
    """Each family's forward on `meta` tensors (tests/engine/test_engine_device.py's
    check): no CPU tensor mixed in, no host sync, in a batch of decodes past
    original_max_position_embeddings, a chunk and a fresh prompt."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_runner import BatchItem, ModelRunner
    from pdserve.engine.request import Request

    path = reference_by_name(name)[0]
    runner = ModelRunner(path, ModelConfig.from_dir(path), torch.float32, torch.device("meta"), 16, 256, "torch")
    runner.allocate_kv_cache(24)
    lengths, done = (90, 91, 40, 30), (89, 90, 8, 0)
    reqs = [Request(f"r{i}", [5] * n, SamplingParams(), 16) for i, n in enumerate(lengths)]
    for r, d in zip(reqs, done):
        r.num_computed_tokens = d
    blocks = iter(range(24))
    batch = [BatchItem(r, n - d, [next(blocks) for _ in range(-(-n // 16))]) for r, n, d in zip(reqs, lengths, done)]
    logits, _ = runner.execute(batch)
    assert logits.device.type == "meta" and logits.shape == (4, 256)


def test_longrope_tokens_do_not_depend_on_the_schedule(reference_by_name):
    """One set of factors per engine: long prompts chunked (their first chunks shorter
    than original_max_position_embeddings), then hitting the prefix cache, keep
    transformers' tokens."""
    path, ps, greedy = reference_by_name("phi3-gqa-longrope")[:3]
    chosen = long_prompts(ps)
    llm = LLM(model=path, max_num_batched_tokens=64, long_prefill_token_threshold=24)
    for _ in range(2):
        outs = llm.generate([ps[i] for i in chosen], greedy_params())
        assert [o.outputs[0].token_ids for o in outs] == [greedy[i] for i in chosen]
    assert llm.stats().prefix_cache_hits > 0
    llm.check_integrity()

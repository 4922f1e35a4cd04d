"""EAGLE heads (methods eagle, eagle3) in the public layouts (tests/eagle_heads.py).

  - the head drafts what transformers' own layers compute from the same weights and
    the same target hidden states (a reference we did not write: HF's LlamaDecoderLayer
    for EAGLE-1, HF's attention, norms and MLP put together as EAGLE-3's layer);
  - the features the target keeps are transformers' hidden states (output_hidden_states);
  - lossless: greedy tokens equal spec-off's and transformers' on Llama, Qwen2 and
    Mistral targets, through preemption and chunked prompts; seeded sampling too;
  - heads that do not fit the target are refused, naming the tensor or the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle_heads import build_eagle_head
from engine_helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from hf_models import build_model, hf_greedy
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ModelConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.model.llama import FeatureCapture
from pdserve.engine.model_runner import BatchItem
from pdserve.engine.spec.eagle import EagleProposer
from pdserve.engine.spec.eagle_head import load_head, read_spec

K = 4
MAX_NEW = 20
KINDS = ("eagle", "eagle3")
PROMPT = [5, 9, 17, 33, 65, 129, 200, 7, 11, 13, 50, 51, 52, 90, 91, 92, 93]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle-target")
    model = build_model(path, "llama", num_hidden_layers=5, tie_word_embeddings=False, initializer_range=0.1)
    return path, model


def head_dir(tmp_path: Path, target_dir: Path, kind: str, **kwargs) -> Path:
    path = tmp_path / kind
    build_eagle_head(path, target_dir, kind, **kwargs)
    return path


# -- the head against transformers' layers --------------------------------------------------


def hf_features(model, tokens: list[int], kind: str, layers: tuple[int, ...]) -> torch.Tensor:
    """The target's features per position, from transformers: EAGLE-1 the final-norm
    hidden state, EAGLE-3 the inputs of `layers` (hidden_states[j] enters layer j)."""
    with torch.no_grad():
        states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    if kind == "eagle":
        return states[-1][0]
    return torch.cat([states[j][0] for j in layers], dim=-1)


class HFHead(nn.Module):
    """The head's layer made of transformers' Llama modules, weights from the checkpoint."""

    def __init__(self, path: Path, kind: str) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
        )

        super().__init__()
        raw = json.loads((path / "config.json").read_text())
        config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        config._attn_implementation = "eager"
        self.kind, self.config = kind, config
        weights = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(path / "model.safetensors")).items()}
        hidden = config.hidden_size
        self.rotary = LlamaRotaryEmbedding(config)
        self.fc = nn.Linear(weights["fc.weight"].shape[1], hidden, bias="fc.bias" in weights)
        self.fc.weight.data = weights["fc.weight"]
        if "fc.bias" in weights:
            self.fc.bias.data = weights["fc.bias"]
        if kind == "eagle":
            self.layer = LlamaDecoderLayer(config, 0)
            self.layer.input_layernorm = nn.Identity()  # EAGLE-1 runs without it
            self.layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items()
                                        if k.startswith("layers.0.")}, strict=False)
            return
        wide = LlamaConfig(**{**config.to_dict(), "hidden_size": 2 * hidden, "head_dim": config.head_dim})
        wide._attn_implementation = "eager"
        self.attn = LlamaAttention(wide, 0)
        self.attn.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, hidden, bias=False)
        self.mlp = LlamaMLP(config)
        self.norms = nn.ModuleDict({n: LlamaRMSNorm(hidden, config.rms_norm_eps) for n in
                                    ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")})
        for name, module in (("self_attn", self.attn), ("mlp", self.mlp)):
            module.load_state_dict({k.removeprefix(f"layers.0.{name}."): v for k, v in weights.items()
                                    if k.startswith(f"layers.0.{name}.")})
        for name, norm in self.norms.items():
            norm.weight.data = weights[f"layers.0.{name}.weight" if name != "norm" else "norm.weight"]
        self.lm_head = nn.Linear(hidden, weights["lm_head.weight"].shape[0], bias=False)
        self.lm_head.weight.data = weights["lm_head.weight"]
        self.d2t = weights["d2t"]

    def outputs(self, embeds: torch.Tensor, hidden: list[torch.Tensor], from_target: list[bool]) -> torch.Tensor:
        """The layer over every row at once (causal, positions 0..T-1)."""
        t = embeds.shape[0]
        positions = torch.arange(t)[None]
        x_rows = []
        for e, h, tgt in zip(embeds, hidden, from_target):
            if self.kind == "eagle":
                x_rows.append(self.fc(torch.cat((e, h))))
            else:
                x_rows.append(self.fc(h) if tgt else h)
        x = torch.stack(x_rows)[None]
        cos_sin = self.rotary(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        if self.kind == "eagle":
            out = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
            return (out[0] if isinstance(out, tuple) else out)[0]
        wide = torch.cat((self.norms["input_layernorm"](embeds[None]), self.norms["hidden_norm"](x)), dim=-1)
        h = x + self.attn(wide, position_embeddings=cos_sin, attention_mask=mask)[0]
        return (h + self.mlp(self.norms["post_attention_layernorm"](h)))[0]

    def token(self, out: torch.Tensor, target_model) -> int:
        if self.kind == "eagle":
            return int(target_model.lm_head(out).argmax())
        best = int(self.lm_head(self.norms["norm"](out)).argmax())
        return best + int(self.d2t[best])


def hf_drafts(target_model, head: HFHead, tokens: list[int], features: torch.Tensor, k: int) -> list[int]:
    """K drafts after `tokens`: rows p = 0..N-2 read (t[p+1], f[p]); each next row the
    draft before and the head's own output before."""
    embed = target_model.model.embed_tokens
    ids = list(tokens[1:])
    hidden = [features[p] for p in range(len(tokens) - 1)]
    from_target = [True] * len(hidden)
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            out = head.outputs(embed(torch.tensor(ids)), hidden, from_target)
            drafts.append(head.token(out[-1], target_model))
            ids.append(drafts[-1])
            hidden.append(out[-1])
            from_target.append(False)
    return drafts


@dataclass
class Seq:
    """What the proposer reads of a sequence."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sampling_params: SamplingParams = field(default_factory=SamplingParams)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


def proposer_for(path: Path, target_dir: Path, kind: str, target_model) -> EagleProposer:
    spec = read_spec(kind, path, ModelConfig.from_dir(target_dir))
    head = load_head(spec, path, torch.float32, torch.device("cpu"), 1024)
    from pdserve.engine.attention import get_backend

    return EagleProposer(head, get_backend("torch", "cpu"), target_model.model.embed_tokens,
                         target_model.lm_head, 64, 16, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", KINDS)
def test_the_head_drafts_what_transformers_layers_compute(tmp_path, target, kind):
    target_dir, model = target
    path = head_dir(tmp_path, target_dir, kind, scale=0.3, draft_vocab=160 if kind == "eagle3" else None,
                    aux_layers=[1, 3, 4] if kind == "eagle3" else None)
    reference = HFHead(path, kind).eval()
    proposer = proposer_for(path, target_dir, kind, model)
    features = hf_features(model, PROMPT, kind, (1, 3, 4))
    want = hf_drafts(model, reference, PROMPT, features, K)
    assert len(set(want)) > 1  # a head that drafts one token over and over would prove little
    proposer.observe("a", 0, features)
    assert proposer.propose([Seq("a", PROMPT)], [K]) == [want]
    # The next token arrives (a rejection): the head's KV is kept up to N-2, the new
    # position's feature catches up, and it drafts as transformers does from scratch.
    longer = PROMPT + [want[0] + 1]
    features = hf_features(model, longer, kind, (1, 3, 4))
    proposer.observe("a", len(PROMPT) - 1, features[len(PROMPT) - 1 :])
    assert proposer.propose([Seq("a", longer)], [K]) == [hf_drafts(model, reference, longer, features, K)]
    proposer.release("a")
    proposer.check_integrity(())
    # A sample forked off the prompt (before any proposal, as the engine forks right
    # after the prefill) drafts from the same features, beside its parent.
    proposer.observe("p", 0, hf_features(model, PROMPT, kind, (1, 3, 4)))
    proposer.fork("p", "c")
    assert proposer.propose([Seq("p", PROMPT), Seq("c", PROMPT)], [K, K]) == [want, want]


@pytest.mark.parametrize("kind, layers", [("eagle", ()), ("eagle3", (0, 2, 4)), ("eagle3", (3, 1, 3))])
def test_the_target_keeps_transformers_hidden_states_from_the_pass_that_scores(target, kind, layers):
    target_dir, model = target
    engine = LLMEngine(EngineConfig(model=str(target_dir)))
    runner = engine.runner
    capture = FeatureCapture(layers=layers) if kind == "eagle3" else FeatureCapture(final=True)
    blocks = list(range(-(-len(PROMPT) // 16)))
    logits, _ = runner.execute([BatchItem(Seq("p", PROMPT), len(PROMPT), blocks)], capture=capture)
    want = hf_features(model, PROMPT, kind, layers)
    assert capture.features is not None and capture.features.shape == want.shape
    assert torch.allclose(capture.features, want, atol=1e-4), (capture.features - want).abs().max()
    with torch.no_grad():
        hf_logits = model(torch.tensor([PROMPT])).logits[0, -1]
    assert torch.allclose(logits[0], hf_logits, atol=1e-4)  # the same pass scored the last token


# -- through the engine: lossless ---------------------------------------------------------------


ARCHS = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-sliding": ("mistral", dict(sliding_window=24)),
}


def prompts() -> list[list[int]]:
    motif = [11, 23, 47, 95, 191]
    return [motif * 6, PROMPT, [7] * 3, list(range(3, 60)), [200]]


@pytest.fixture(scope="module", params=list(ARCHS))
def family(request, tmp_path_factory):
    arch, overrides = ARCHS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = build_model(path, arch, num_hidden_layers=4, **overrides)
    heads = {}
    for kind in KINDS:
        heads[kind] = tmp_path_factory.mktemp(f"{request.param}-{kind}")
        build_eagle_head(heads[kind], path, kind, seed=3, draft_vocab=200 if kind == "eagle3" else None)
    return path, heads, [hf_greedy(model, p, MAX_NEW) for p in prompts()]


def config(path: Path, kind: str) -> dict:
    return {"method": kind, "num_speculative_tokens": K, "model": str(path), "measure_payoff": False}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [{}, dict(num_blocks=12, max_num_batched_tokens=256),
                                  dict(max_num_batched_tokens=32, long_prefill_token_threshold=8)],
                         ids=["plain", "preempted", "chunked"])
def test_greedy_equals_spec_off_and_transformers(family, kind, mode):
    path, heads, expected = family
    llm = LLM(model=str(path), speculative_config=config(heads[kind], kind), **mode)
    outs = llm.generate(prompts(), SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == expected
    spec = llm.stats().spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(o.num_draft_tokens for o in outs) == spec.num_draft_tokens
    if "num_blocks" in mode:
        assert llm.stats().num_preemptions > 0
    llm.check_integrity()
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_sampling_is_the_same_with_eagle_on_and_off(family, kind):
    path, heads, _ = family
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=5, n=2)
    off = LLM(model=str(path)).generate(prompts(), params)
    llm = LLM(model=str(path), speculative_config=config(heads[kind], kind))
    on = llm.generate(prompts(), params)
    assert [[s.token_ids for s in o.outputs] for o in on] == [[s.token_ids for s in o.outputs] for o in off]
    llm.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_samples_forked_off_the_prompt_draft_from_its_features(family, kind):
    """n = 3 greedy: three identical samples, each drafting as the lone n = 1 request
    does (the forks start with the prompt's features, not at their first token)."""
    path, heads, expected = family
    counts = []
    for n in (1, 3):
        llm = LLM(model=str(path), speculative_config=config(heads[kind], kind))
        outs = llm.generate([prompts()[1]], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=n))
        assert [s.token_ids for s in outs[0].outputs] == [expected[1]] * n
        spec = llm.stats().spec_decode
        counts.append((spec.num_draft_tokens, spec.num_accepted_tokens))
        llm.check_integrity()
    assert counts[1] == (3 * counts[0][0], 3 * counts[0][1]), counts


def test_the_committed_head_drafts_for_the_embedded_model_losslessly():
    """models/pdserve-tiny-code-eagle3 (scripts/train_eagle_head.py) loads against the
    embedded model, its tokens are spec-off's, and it guesses right more than by chance."""
    from pdserve.engine.config import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL

    prompt = "def read_lines(path):\n    with open(path) as f:\n"
    params = SamplingParams(max_tokens=48, temperature=0.0)
    off = LLM(model=DEFAULT_MODEL, num_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(model=DEFAULT_MODEL, num_blocks=64, speculative_config=config(Path(DEFAULT_EAGLE3_HEAD), "eagle3"))
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == off
    spec = llm.stats().spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens / spec.num_draft_tokens > 0.2, spec
    llm.check_integrity()


# -- heads that do not fit ------------------------------------------------------------------------


def rewrite(path: Path, change) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def refusal(path: Path, target_dir: Path, kind: str) -> str:
    with pytest.raises(ValueError) as info:
        LLM(model=str(target_dir), speculative_config=config(path, kind))
    return str(info.value)


@pytest.mark.parametrize("kind, tensor, shape", [
    ("eagle", "fc.weight", (64, 96)),
    ("eagle", "layers.0.self_attn.k_proj.weight", (48, 64)),
    ("eagle3", "fc.weight", (64, 128)),
    ("eagle3", "midlayer.self_attn.q_proj.weight", (64, 64)),
    ("eagle3", "lm_head.weight", (100, 64)),
    ("eagle3", "d2t", (99,)),
])
def test_a_tensor_that_does_not_fit_is_named(tmp_path, target, kind, tensor, shape):
    target_dir, _ = target
    path = head_dir(tmp_path, target_dir, kind, draft_vocab=160 if kind == "eagle3" else None)
    rewrite(path, lambda t: t.__setitem__(tensor, torch.zeros(shape, dtype=t[tensor].dtype)))
    message = refusal(path, target_dir, kind)
    name = tensor.replace("midlayer.", "").replace("layers.0.", "")
    assert f"tensor {name} has shape {shape}" in message and "speculative_config.model" in message


def test_missing_and_unknown_tensors_are_named(tmp_path, target):
    target_dir, _ = target
    path = head_dir(tmp_path, target_dir, "eagle3")
    rewrite(path, lambda t: t.pop("midlayer.hidden_norm.weight"))
    assert "lacks hidden_norm.weight" in refusal(path, target_dir, "eagle3")
    rewrite(path, lambda t: t.__setitem__("midlayer.extra.weight", torch.zeros(2)))
    assert "unknown tensor extra.weight" in refusal(path, target_dir, "eagle3")


@pytest.mark.parametrize("edit, words", [
    (dict(eagle_aux_hidden_state_layer_ids=[1, 3, 9]), "eagle_aux_hidden_state_layer_ids [1, 3, 9]: [9] not a layer"),
    (dict(num_hidden_layers=2), "num_hidden_layers 2"),
    (dict(target_hidden_size=128), "target_hidden_size 128 differs"),
    (dict(vocab_size=300), "vocab_size 300 differs"),
])
def test_a_config_that_does_not_fit_is_refused_by_its_key(tmp_path, target, edit, words):
    target_dir, _ = target
    path = head_dir(tmp_path, target_dir, "eagle3")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **edit}))
    assert words in refusal(path, target_dir, "eagle3")


def test_an_eagle1_head_must_have_the_targets_hidden_size(tmp_path, target):
    target_dir, _ = target
    path = head_dir(tmp_path, target_dir, "eagle", hidden_size=32, intermediate_size=64, head_dim=8)
    assert "hidden_size 32 differs from the target's 64" in refusal(path, target_dir, "eagle")

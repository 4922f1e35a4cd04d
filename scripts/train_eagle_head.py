"""Train an EAGLE-3 draft head for ``models/pdserve-tiny-code``: ``models/pdserve-tiny-code-eagle3``.

The target is frozen; the head (engine/spec/eagle_head.py's math and checkpoint layout)
learns from the target's own features on the stdlib corpus that trained the target,
with scripts/train_default_model.py's corpus, tokenizer and held-out split::

    .venv/bin/python scripts/train_eagle_head.py                  # writes models/pdserve-tiny-code-eagle3
    .venv/bin/python scripts/train_eagle_head.py --steps 20 --self-distill 64 --out /tmp/h   # smoke run

Training-time test (EAGLE-3), as engine/spec/eagle.py drafts. For a window t[0..L-1],
row p (0 <= p <= L-2) of every step reads the embedding of t[p+1] and predicts t[p+2]:

    step 0  hidden g = fc([a[p]; b[p]; c[p]]) (the inputs of the target's layers 1, 2, 3);
            its K/V are the "rows fed the target's features"; attends causally (<= p)
    step j  hidden = the head's step j-1 output at p-1 (no fc): the chain anchored at
            a = p - j; attends to the step-0 K/V of positions <= a and to its own chain's
            K/V of steps 1 .. j (positions a+1 .. p), exactly the draft rows of inference

Rows with p < j have no anchor and are left out of the loss. The loss of step j is the
cross-entropy of the head's draft logits against the target's own distribution over the
draft vocabulary (softmax of its logits at p+1, restricted to the draft vocabulary),
weighted by DECAY**j and summed over STEPS_DEEP steps. The draft vocabulary is the
DRAFT_VOCAB most frequent tokens of the training text (d2t maps them back).

Self-distillation (EAGLE's practice; --self-distill N, default 1024): at serving time the head
drafts the target's own greedy continuations (which often loop), not human-written text, so
before training the script draws N prompts (64-128 tokens, seeded) from the TRAINING split's
tokens only and continues each by 192 greedy tokens with pdserve's engine (spec off,
ignore_eos, one batched llm.generate call). A self-distillation window is a prompt's last 64
tokens and its whole continuation (256 tokens); --sd-per-batch (default 7) of each batch's 8
windows are drawn from them, the rest from the corpus. --self-distill 0 trains on corpus
windows only.

The run is seeded and its step count fixed, so the same torch, Python (the corpus is its
stdlib) and --threads give the same head. At the end it runs pdserve's engine on held-out
free-completion prompts (bench/spec/workloads.py: functions of files the target never
trained on), greedy, K=4, measure_payoff off, checks that eagle3's tokens equal spec-off's,
and prints ``eagle_acceptance_length=X draft_acceptance_length=Y ngram_acceptance_length=Z``
(mean acceptance length = 1 + accepted / drafts); the line also goes to the head's README.md.

The committed head (7.2 MB, fp32, 1.8M parameters) is this script's defaults: 1024 prompts x
192 greedy tokens of self-distillation (1.6 min), then 1800 steps of 8 x 256 tokens (7
self-distilled + 1 corpus window each), 22.9 min of training (0.77 s/step, --threads 2, on
this 2-core machine, nothing else running); 24.8 min in all with the acceptance check. Train
top-1 agreement with the target by step 0.829 0.833 0.831 0.826 at the end. Held-out free completion, 24 prompts
x 96 tokens::

    eagle_acceptance_length=3.355 draft_acceptance_length=2.329 ngram_acceptance_length=3.403

Longer training is what moved it (same script, one thread): 500 steps with 6 self-distilled
windows a batch gave 2.705, 1000 steps with 7 gave 2.983; the head trained on corpus windows
only (600 steps) 2.228. On bench.spec.methods's free-completion workload the committed head is above
n-gram (3.24 against 2.64: docs/benchmarks.md); on this check's prompts it is just below (the
greedy continuations of this tiny target often loop, which prompt lookup predicts best).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_default_model as tdm  # noqa: E402  (the target's corpus, tokenizer and split)

from pdserve.engine.config import ModelConfig  # noqa: E402
from pdserve.engine.model.llama import RMSNorm  # noqa: E402
from pdserve.engine.model.rope import RotaryEmbedding, apply_rotary  # noqa: E402

TARGET = Path("models/pdserve-tiny-code")
DRAFT = Path("models/pdserve-tiny-code-draft")
AUX_LAYERS = (1, 2, 3)  # layer inputs: hidden_states[j] of HF's output_hidden_states enters layer j


@dataclass(frozen=True)
class HeadTrainConfig:
    target: Path = TARGET
    out: Path = Path("models/pdserve-tiny-code-eagle3")
    steps: int = 1800
    threads: int = 2
    seed: int = 0
    steps_deep: int = 4  # training-time test depth (K = 4 drafts at inference)
    decay: float = 0.8  # step j's loss weight: decay ** j
    draft_vocab: int = 3072
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    log_every: int = 25
    # Self-distillation (EAGLE's practice): the target's own greedy continuations of
    # training-split prompts; batches mix them with corpus windows.
    self_distill: int = 1024  # prompts continued (0: corpus windows only)
    sd_prompt_len: tuple[int, int] = (64, 128)  # prompt length drawn uniformly in [lo, hi]
    sd_new_tokens: int = 192  # greedy tokens generated per prompt
    sd_per_batch: int = 7  # windows of a batch drawn from the self-distillation data
    # Evaluation (held-out free completion).
    eval_prompts: int = 24
    eval_max_tokens: int = 96
    num_speculative_tokens: int = 4


def parse_args(argv: Sequence[str] | None = None) -> HeadTrainConfig:
    base = HeadTrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=base.steps, help="optimizer steps (%(default)s)")
    parser.add_argument("--threads", type=int, default=base.threads, help="CPU threads (%(default)s)")
    parser.add_argument("--out", type=Path, default=base.out, help="output directory (%(default)s)")
    parser.add_argument("--seed", type=int, default=base.seed, help="random seed (%(default)s)")
    parser.add_argument("--self-distill", type=int, default=base.self_distill,
                        help="training-split prompts whose greedy continuations by the target (pdserve's "
                             "engine) are trained on (%(default)s; 0: corpus windows only)")
    parser.add_argument("--sd-per-batch", type=int, default=base.sd_per_batch,
                        help=f"windows of each {base.batch_size}-window batch drawn from the self-distillation "
                             "data, the rest from the corpus (%(default)s)")
    parser.add_argument("--eval-prompts", type=int, default=base.eval_prompts,
                        help="held-out prompts of the acceptance check (%(default)s; 0 skips it)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1 or args.eval_prompts < 0 or args.self_distill < 0:
        parser.error("--steps and --threads must be >= 1, --eval-prompts and --self-distill >= 0")
    if not 0 <= args.sd_per_batch <= base.batch_size:
        parser.error(f"--sd-per-batch must be in [0, {base.batch_size}]")
    return replace(base, steps=args.steps, threads=args.threads, out=args.out, seed=args.seed,
                   eval_prompts=args.eval_prompts, self_distill=args.self_distill,
                   sd_per_batch=args.sd_per_batch if args.self_distill else 0)


# --------------------------------------------------------------------------- the head


class Eagle3Head(nn.Module):
    """EAGLE-3's layer for training; parameter names are the checkpoint's (midlayer.*
    under `midlayer`), unfused, so its state dict is the checkpoint."""

    def __init__(self, cfg: ModelConfig, draft_vocab: int, num_aux: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.midlayer = nn.Module()
        attn = self.midlayer.self_attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, cfg.q_size, bias=False)
        attn.k_proj = nn.Linear(2 * h, cfg.kv_size, bias=False)
        attn.v_proj = nn.Linear(2 * h, cfg.kv_size, bias=False)
        attn.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        mlp = self.midlayer.mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.midlayer.input_layernorm = RMSNorm(h, eps)
        self.midlayer.hidden_norm = RMSNorm(h, eps)
        self.midlayer.post_attention_layernorm = RMSNorm(h, eps)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)

    def qkv(self, embeds: torch.Tensor, g: torch.Tensor,
            rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, D] and k, v [B, kv_heads, T, D] of rows (embedding, hidden g)."""
        cfg, layer = self.cfg, self.midlayer
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(g)), dim=-1)
        b, t, _ = x.shape
        attn = layer.self_attn
        q = attn.q_proj(x).view(b * t, cfg.num_heads, cfg.head_dim)
        k = attn.k_proj(x).view(b * t, cfg.num_kv_heads, cfg.head_dim)
        v = attn.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)  # rotary: [B * T, 1, D], rows batch-major

        def by_head(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, -1, cfg.head_dim).transpose(1, 2)

        return by_head(q), by_head(k), v.transpose(1, 2)

    def finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output from its hidden g and the attention result [B, heads, T, D]."""
        b, _, t, _ = attended.shape
        layer = self.midlayer
        h = g + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        x = layer.post_attention_layernorm(h)
        return h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))


def ttt_mask(t: int, step: int, device: torch.device) -> torch.Tensor:
    """Which keys step `step`'s row p attends to, bool [T, (step + 1) * T]: block 0 (the
    step-0 rows) at positions <= p - step, block i >= 1 (step i's rows) at p - step + i
    only (its own chain)."""
    p = torch.arange(t, device=device)[:, None]
    q = torch.arange(t, device=device)[None, :]
    blocks = [q <= p - step] + [q == p - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def head_steps(head: Eagle3Head, embeds: torch.Tensor, features: torch.Tensor, rope: RotaryEmbedding,
               depth: int) -> list[torch.Tensor]:
    """The head's draft logits [B, T, draft_vocab] of steps 0 .. depth-1 over rows
    (embeds[p] = embedding of t[p+1], features[p] = the target's at p)."""
    cfg = head.cfg
    b, t, _ = embeds.shape
    positions = torch.arange(t, device=embeds.device).repeat(b)
    rotary = rope.lookup(positions, embeds.dtype)
    g = head.fc(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out_logits: list[torch.Tensor] = []
    groups = cfg.num_heads // cfg.num_kv_heads
    for step in range(depth):
        q, k, v = head.qkv(embeds, g, rotary)
        keys.append(k.repeat_interleave(groups, dim=1))
        values.append(v.repeat_interleave(groups, dim=1))
        mask = ttt_mask(t, step, embeds.device)
        attended = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                  attn_mask=mask, scale=cfg.head_dim**-0.5)
        out = head.finish(g, attended)
        out_logits.append(head.logits(out))
        g = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)  # row p reads the output at p-1
    return out_logits


# --------------------------------------------------------------------------- data and target


@dataclass(frozen=True)
class TargetBatch:
    embeds: torch.Tensor  # [B, T, H]: embedding of t[p+1]
    features: torch.Tensor  # [B, T, 3H]: the inputs of AUX_LAYERS at p
    probs: torch.Tensor  # [B, T, draft_vocab]: the target's distribution of t[p+2], draft vocab only


@torch.no_grad()
def target_batch(target: LlamaForCausalLM, ids: torch.Tensor, keep: torch.Tensor) -> TargetBatch:
    """The frozen target's view of windows ids [B, L]: rows p = 0 .. L-2."""
    out = target(input_ids=ids, output_hidden_states=True)
    states = out.hidden_states
    features = torch.cat([states[j][:, :-1] for j in AUX_LAYERS], dim=-1)
    embeds = target.model.embed_tokens(ids[:, 1:])
    probs = out.logits[:, 1:, keep].softmax(dim=-1)
    return TargetBatch(embeds, features, probs)


def draft_vocabulary(data: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the training data, sorted by id: draft id d is
    target id keep[d]. Ties at the boundary (the committed head's: count 130) go as
    torch.topk orders them on the CPU, fixed for a given torch version."""
    counts = torch.bincount(data, minlength=vocab)
    top = torch.topk(counts, size, sorted=True).indices
    return torch.sort(top).values


def ttt_loss(cfg: HeadTrainConfig, logits: list[torch.Tensor], probs: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Sum over steps of decay**j * soft cross-entropy on rows p >= j; also each step's top-1
    agreement with the target's argmax (within the draft vocabulary)."""
    total = logits[0].new_zeros(())
    agree = []
    best = probs.argmax(dim=-1)
    for step, lg in enumerate(logits):
        lg, pr = lg[:, step:], probs[:, step:]
        ce = -(pr * lg.log_softmax(dim=-1)).sum(dim=-1).mean()
        total = total + cfg.decay**step * ce
        agree.append((lg.argmax(dim=-1) == best[:, step:]).float().mean().item())
    return total, agree


@torch.no_grad()
def self_distill_data(cfg: HeadTrainConfig, data: torch.Tensor) -> torch.Tensor:
    """Windows [N, seq_len] of the target's own greedy text: N prompts drawn (seeded) from the
    TRAINING split's tokens, each continued by sd_new_tokens greedy tokens with pdserve's
    engine (spec off, ignore_eos); a window is the prompt's last seq_len - sd_new_tokens
    tokens and the whole continuation."""
    from pdserve.engine import LLM, SamplingParams

    context = cfg.seq_len - cfg.sd_new_tokens
    lo, hi = cfg.sd_prompt_len
    if not 0 < context <= lo <= hi:
        raise ValueError("self-distillation windows need seq_len - sd_new_tokens in (0, prompt length]")
    generator = torch.Generator().manual_seed(cfg.seed + 7)
    lengths = torch.randint(lo, hi + 1, (cfg.self_distill,), generator=generator).tolist()
    starts = torch.randint(0, data.numel() - hi, (cfg.self_distill,), generator=generator).tolist()
    prompts = [data[s : s + n].tolist() for s, n in zip(starts, lengths)]
    start = time.monotonic()
    llm = LLM(model=str(cfg.target))
    params = SamplingParams(max_tokens=cfg.sd_new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    windows = [list(p[-context:]) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]
    del llm
    if any(len(w) != cfg.seq_len for w in windows):
        raise RuntimeError("self-distillation: a continuation came back short")
    elapsed = time.monotonic() - start
    print(f"self-distillation: {len(windows)} prompts x {cfg.sd_new_tokens} greedy tokens in {elapsed / 60:.1f} min",
          flush=True)
    return torch.tensor(windows, dtype=torch.long)


def mixed_batch(cfg: HeadTrainConfig, data: torch.Tensor, distilled: torch.Tensor | None,
                generator: torch.Generator) -> torch.Tensor:
    """A [batch_size, seq_len] batch: sd_per_batch self-distillation windows, then corpus windows."""
    own = cfg.sd_per_batch if distilled is not None else 0
    rows = []
    if own:
        rows.append(distilled[torch.randint(0, distilled.shape[0], (own,), generator=generator)])
    if cfg.batch_size - own:
        window = replace(tdm.TrainConfig(), seq_len=cfg.seq_len, batch_size=cfg.batch_size - own)
        rows.append(tdm.sample_batch(data, window, generator))
    return torch.cat(rows)


# --------------------------------------------------------------------------- training


def lr_at(cfg: HeadTrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    warmup = min(cfg.warmup_steps, max(cfg.steps // 10, 1))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min((step - warmup) / max(cfg.steps - warmup, 1), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: HeadTrainConfig, head: Eagle3Head, target: LlamaForCausalLM, rope: RotaryEmbedding,
          data: torch.Tensor, keep: torch.Tensor, distilled: torch.Tensor | None = None) -> None:
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    start = time.monotonic()
    losses: list[float] = []
    agrees: list[list[float]] = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        batch = target_batch(target, mixed_batch(cfg, data, distilled, generator), keep)
        loss, agree = ttt_loss(cfg, head_steps(head, batch.embeds, batch.features, rope, cfg.steps_deep),
                               batch.probs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        agrees.append(agree)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            top1 = " ".join(f"{sum(a[j] for a in agrees) / len(agrees):.3f}" for j in range(cfg.steps_deep))
            elapsed = time.monotonic() - start
            print(f"step {step + 1:4d}/{cfg.steps}  loss {sum(losses) / len(losses):.4f}  top1 by step {top1}  "
                  f"lr {lr_at(cfg, step):.2e}  {elapsed / (step + 1):.2f} s/step  {elapsed / 60:.1f} min", flush=True)
            losses, agrees = [], []


# --------------------------------------------------------------------------- output


def head_config(target_dir: Path, draft_vocab: int) -> dict:
    """config.json as engine/spec/eagle_head.py reads it: the target's layer shape and RoPE."""
    target = json.loads((target_dir / "config.json").read_text())
    copied = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
              "rope_scaling", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        **{k: target[k] for k in copied if k in target},
        "draft_vocab_size": draft_vocab, "target_hidden_size": target["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS), "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "dtype": "float32",
    }


def save_head(cfg: HeadTrainConfig, head: Eagle3Head, keep: torch.Tensor, vocab: int) -> None:
    """config.json and model.safetensors (the checkpoint's names, plus d2t and t2d)."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in head.state_dict().items()}
    tensors["d2t"] = keep - torch.arange(keep.numel())
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(cfg.out / "model.safetensors"))
    (cfg.out / "config.json").write_text(json.dumps(head_config(cfg.target, keep.numel()), indent=2) + "\n")
    size = (cfg.out / "model.safetensors").stat().st_size
    print(f"saved {cfg.out} (model.safetensors {size / 1e6:.2f} MB)", flush=True)


# --------------------------------------------------------------------------- acceptance


def held_out_prompts(target: Path, count: int) -> list[list[int]]:
    """Free-completion prompts from held-out functions (files the target never trained on),
    as bench/spec/methods.py's completion workload draws them (seed 0)."""
    from pdserve.bench.spec.workloads import draw_functions, make_requests
    from pdserve.engine.tokenizer import Tokenizer

    encode = Tokenizer(str(target)).encode
    fns = draw_functions(encode, count, (96, 400), seed=0)
    return [list(r.prompt) for r in make_requests("completion", fns, encode, 0)]


def acceptance(cfg: HeadTrainConfig, prompts: list[list[int]], method: str | None) -> tuple[float, list[list[int]]]:
    """Mean acceptance length (1 + accepted / drafts) of `method` (None: spec off) and its tokens."""
    from pdserve.engine import LLM, SamplingParams

    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": cfg.num_speculative_tokens, "measure_payoff": False}
        if method != "ngram":
            spec["model"] = str(cfg.out if method == "eagle3" else DRAFT)
    llm = LLM(model=str(cfg.target), speculative_config=spec)
    params = SamplingParams(max_tokens=cfg.eval_max_tokens, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.stats().spec_decode
    length = 1 + stats.num_accepted_tokens / stats.num_drafts if method and stats.num_drafts else math.nan
    return length, tokens


def report_acceptance(cfg: HeadTrainConfig) -> str:
    """The acceptance line of eagle3 (the head in cfg.out), draft_model and ngram on the same
    held-out prompts; RuntimeError if any method's greedy tokens differ from spec-off's."""
    prompts = held_out_prompts(cfg.target, cfg.eval_prompts)
    _, off = acceptance(cfg, prompts, None)
    lengths = {}
    for method in ("eagle3", "draft_model", "ngram"):
        lengths[method], tokens = acceptance(cfg, prompts, method)
        if tokens != off:
            raise RuntimeError(f"{method}: greedy tokens differ from spec-off's")
    line = (f"eagle_acceptance_length={lengths['eagle3']:.3f} draft_acceptance_length={lengths['draft_model']:.3f} "
            f"ngram_acceptance_length={lengths['ngram']:.3f}")
    print(f"held-out free completion: {len(prompts)} prompts x {cfg.eval_max_tokens} tokens, greedy, "
          f"K={cfg.num_speculative_tokens}; every method's tokens equal spec-off's", flush=True)
    return line


def write_readme(cfg: HeadTrainConfig, line: str, minutes: float) -> None:
    sd = (f"; {cfg.sd_per_batch} of each batch's windows from the target's own greedy continuations "
          f"({cfg.self_distill} training-split prompts x {cfg.sd_new_tokens} tokens)" if cfg.self_distill else "")
    (cfg.out / "README.md").write_text(
        f"# pdserve-tiny-code-eagle3\n\nAn EAGLE-3 draft head for models/pdserve-tiny-code, trained by "
        f"scripts/train_eagle_head.py ({cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens, "
        f"training-time test {cfg.steps_deep} steps deep, draft vocabulary {cfg.draft_vocab}, "
        f"--threads {cfg.threads}, {minutes:.1f} min of training{sd}).\n\n"
        f"Held-out free completion ({cfg.eval_prompts} prompts x {cfg.eval_max_tokens} tokens, greedy, "
        f"num_speculative_tokens {cfg.num_speculative_tokens}, measure_payoff false), mean acceptance "
        f"length = 1 + accepted / drafts:\n\n    {line}\n")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(cfg.threads)
    torch.set_num_threads(cfg.threads)
    tdm.seed_everything(cfg.seed)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {cfg.threads} thread(s)", flush=True)

    corpus = tdm.collect_corpus(tdm.TrainConfig())
    tokenizer = tdm.load_target_tokenizer(cfg.target)
    data = tdm.tokenize(tokenizer, corpus.train)
    keep = draft_vocabulary(data, len(tokenizer), cfg.draft_vocab)
    coverage = torch.isin(data, keep).float().mean().item()
    print(f"tokens: {data.numel():,} train; draft vocabulary {cfg.draft_vocab} covers {coverage:.3f}", flush=True)

    target = LlamaForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval().requires_grad_(False)
    model_cfg = ModelConfig.from_hf_config({**json.loads((cfg.target / "config.json").read_text())})
    rope = RotaryEmbedding(model_cfg.rope, model_cfg.head_dim, cfg.seq_len, torch.device("cpu"))
    distilled = self_distill_data(cfg, data) if cfg.self_distill else None
    head = Eagle3Head(model_cfg, cfg.draft_vocab, len(AUX_LAYERS))
    print(f"head: {sum(p.numel() for p in head.parameters()):,} parameters", flush=True)
    start = time.monotonic()
    train(cfg, head, target, rope, data, keep, distilled)
    minutes = (time.monotonic() - start) / 60
    save_head(cfg, head, keep, len(tokenizer))
    if cfg.eval_prompts:
        line = report_acceptance(cfg)
        write_readme(cfg, line, minutes)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

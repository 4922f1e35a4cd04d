"""EAGLE draft heads in the public checkpoint layouts (vLLM's `eagle` and `eagle3`).

A head is one small decoder layer that drafts from the target's own hidden states.
Position p's row reads the token after p and the target's feature at p, and guesses
the token after that:

    eagle  (EAGLE-1/2)  x = fc([embed(t[p+1]); f[p]])        f: the target's final-norm
                        out = layer(x)                          hidden state (its input
                        logits = the target's LM head(out)      norm off, as EAGLE has it)
    eagle3 (EAGLE-3)    g = fc([a[p]; b[p]; c[p]])            a, b, c: the residual stream
                        x = [input_layernorm(embed(t[p+1]));    entering three of the
                             hidden_norm(g)]                    target's layers (2H wide:
                        h = g + o_proj(attn(x))                 q, k and v read it)
                        out = h + mlp(post_attention_layernorm(h))
                        logits = lm_head(norm(out)) over the draft vocabulary, each
                        draft id d standing for target id d + d2t[d]

Drafting further, the head's own `out` stands in for the target's feature (for eagle3
without fc). Tensors, as the EAGLE repositories and vLLM name them (`midlayer.` is
EAGLE-3's name for `layers.0.`): fc.weight (+ fc.bias), layers.0.self_attn.{q,k,v,o}_proj,
layers.0.mlp.{gate,up,down}_proj, layers.0.post_attention_layernorm; eagle3 also
layers.0.input_layernorm, layers.0.hidden_norm, norm, lm_head and d2t (t2d is not
needed); embed_tokens when the head has its own (else the target's is used). Every
shape is checked against the target's at load, and a tensor that does not fit is
refused by name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.model.llama import MLP, RMSNorm
from pdserve.engine.model.loader import iter_tensors, materialize
from pdserve.engine.model.rope import RotaryEmbedding, apply_rotary

KEY = "speculative_config.model"
KINDS = ("eagle", "eagle3")
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class HeadSpec:
    """A head's shape, from its config.json, checked against the target's."""

    kind: str  # "eagle" | "eagle3"
    cfg: ModelConfig  # the head's layer (hidden size, heads, RoPE), read as a Llama config
    target_hidden: int
    aux_layers: tuple[int, ...]  # eagle3: the target layers whose input it reads; eagle: ()
    draft_vocab: int  # eagle3: its LM head's rows; eagle: the target's vocabulary

    @property
    def feature_size(self) -> int:
        """What the target hands over per position."""
        return self.target_hidden * (len(self.aux_layers) if self.kind == "eagle3" else 1)

    @property
    def qkv_in(self) -> int:
        return 2 * self.cfg.hidden_size if self.kind == "eagle3" else self.cfg.hidden_size


def read_spec(kind: str, head_dir: str | Path, target: ModelConfig) -> HeadSpec:
    """The head's config.json, as the target needs it; ValueError naming what does not fit."""
    if kind not in KINDS:
        raise ValueError(f"speculative_config.method: {kind!r} is not an EAGLE method ({', '.join(KINDS)})")
    path = Path(head_dir) / "config.json"
    raw = json.loads(path.read_text())
    if raw.get("add_para_norm"):
        raise ValueError(f"{KEY}: add_para_norm (the HASS variant) is not supported ({head_dir})")
    cfg = ModelConfig.from_hf_config({**raw, "architectures": ["LlamaForCausalLM"]})
    if cfg.num_layers != 1:
        raise ValueError(f"{KEY}: num_hidden_layers {cfg.num_layers}: an EAGLE head has one decoder layer "
                         f"({head_dir})")
    if kind == "eagle" and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"{KEY}: hidden_size {cfg.hidden_size} differs from the target's {target.hidden_size}: "
                         f"an EAGLE-1 head reads the target's hidden states and LM head ({head_dir})")
    target_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(f"{KEY}: target_hidden_size {target_hidden} differs from the target's hidden_size "
                         f"{target.hidden_size} ({head_dir})")
    if kind == "eagle":
        return HeadSpec(kind, cfg, target_hidden, (), target.vocab_size)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{KEY}: vocab_size {cfg.vocab_size} differs from the target's {target.vocab_size} "
                         f"({head_dir})")
    layers = aux_layer_ids(raw, target.num_layers)
    draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
    return HeadSpec(kind, cfg, target_hidden, layers, draft_vocab)


def aux_layer_ids(raw: dict, num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three target layers (vLLM's ids: id j is layer j's input), from the
    head's config (top level, or its eagle_config), else vLLM's default: a low, a
    middle and a high layer."""
    eagle = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if num_layers < 4:
            raise ValueError(f"{KEY}: the target has {num_layers} layers: too few for EAGLE-3's default layers "
                             "(2, L // 2, L - 3); give eagle_aux_hidden_state_layer_ids")
        ids = (2, num_layers // 2, num_layers - 3)
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{KEY}: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{KEY}: eagle_aux_hidden_state_layer_ids {list(ids)}: {bad} not a layer of the target's "
                         f"{num_layers} (ids are layer inputs, 0 .. {num_layers - 1})")
    return tuple(ids)


class HeadAttention(nn.Module):
    """Attention of the head's layer: q, k, v read `width` features, o_proj writes H."""

    def __init__(self, cfg: ModelConfig, width: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(width, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rotary, kv, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rotary(qk, *rotary).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        o = backend.forward(q, k, v, kv, meta, self.scale, None, (1.0, 1.0))
        return self.o_proj(o.reshape(-1, cfg.q_size))


class EagleHead(nn.Module):
    def __init__(self, spec: HeadSpec, rope: RotaryEmbedding, fc_bias: bool = False) -> None:
        super().__init__()
        cfg, hidden = spec.cfg, spec.cfg.hidden_size
        self.spec = spec
        self.rope = rope
        self.digest = ""  # the checkpoint's fingerprint (load_head): workers pair only with the same head
        fc_in = spec.feature_size if spec.kind == "eagle3" else 2 * hidden
        self.fc = nn.Linear(fc_in, hidden, bias=fc_bias)  # EAGLE-1's own checkpoints have a bias
        self.self_attn = HeadAttention(cfg, spec.qkv_in)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.embed_tokens: nn.Embedding | None = None  # its own, when the checkpoint has one
        if spec.kind == "eagle3":
            self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, spec.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab, dtype=torch.long))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, from_target: bool, positions: torch.Tensor,
                kv: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The head's output per row (what the next draft step reads as its hidden
        state): `hidden` is the target's features (`from_target`) or the head's own
        output of the row before."""
        rotary = self.rope.lookup(positions, embeds.dtype)
        if self.spec.kind == "eagle":
            x = self.fc(torch.cat((embeds, hidden), dim=-1))
            h = x + self.self_attn(x, rotary, kv, meta, backend)  # no input norm (EAGLE-1)
            return h + self.mlp(self.post_attention_layernorm(h))
        g = self.fc(hidden) if from_target else hidden
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(g)), dim=-1)
        h = g + self.self_attn(x, rotary, kv, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def draft_tokens(self, out: torch.Tensor, target_logits) -> torch.Tensor:
        """Greedy draft token ids (target ids) for each row's output."""
        if self.spec.kind == "eagle":
            return target_logits(out).argmax(dim=-1)
        best = self.lm_head(self.norm(out)).argmax(dim=-1)
        return best + self.d2t[best]


def load_head(spec: HeadSpec, head_dir: str | Path, dtype: torch.dtype, device: torch.device,
              max_positions: int) -> EagleHead:
    """The head with its checkpoint's weights; ValueError naming a tensor that is
    missing, unknown, or of a shape that does not fit."""
    tensors = [(_canonical(name), tensor) for name, tensor in iter_tensors(Path(head_dir))]
    digest = hashlib.sha256(f"{spec.kind};{spec.aux_layers};{spec.draft_vocab}".encode())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):  # the checkpoint, as stored
        digest.update(f"{name};{tensor.dtype};{tuple(tensor.shape)};".encode())
        digest.update(tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    rope = RotaryEmbedding(spec.cfg.rope, spec.cfg.head_dim, max_positions, device)
    with torch.device("meta"):
        head = EagleHead(spec, rope, fc_bias=any(name == "fc.bias" for name, _ in tensors)).to(dtype)
    head = materialize(head, device)
    params = dict(head.named_parameters()) | dict(head.named_buffers())
    if spec.kind == "eagle3":
        params["d2t"].zero_()  # a full draft vocabulary maps each id to itself
    filled: dict[str, set[int]] = {}
    for name, tensor in tensors:
        _load_one(head, spec, params, filled, name, tensor)
    shards = {"self_attn.qkv_proj.weight": 3, "self_attn.qkv_proj.bias": 3, "mlp.gate_up_proj.weight": 2,
              "mlp.gate_up_proj.bias": 2}
    optional = {"d2t"} if spec.kind == "eagle3" and spec.draft_vocab == spec.cfg.vocab_size else set()
    missing = sorted(n for n in params if n not in optional and len(filled.get(n, ())) < shards.get(n, 1))
    if missing:
        raise ValueError(f"{KEY}: the head's checkpoint lacks {', '.join(missing)} ({head_dir})")
    head.digest = digest.hexdigest()[:16]
    return head.eval()


def _canonical(name: str) -> str:
    """A checkpoint name in our module's terms (prefixes dropped, midlayer = layer 0)."""
    for prefix in ("model.", "eagle."):
        if name.startswith(prefix) and not name.startswith("model.lm_head"):
            name = name[len(prefix):]
    name = name.replace("midlayer.", "layers.0.")
    return name.removeprefix("layers.0.")


def _load_one(head: EagleHead, spec: HeadSpec, params: dict[str, torch.Tensor], filled: dict[str, set[int]],
              name: str, tensor: torch.Tensor) -> None:
    if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
        return  # not needed to draft (d2t maps back); RoPE tables are ours
    if name == "input_layernorm.weight" and spec.kind == "eagle":
        return  # EAGLE-1 runs its layer without the input norm
    if name == "embed_tokens.weight":
        expected = (spec.cfg.vocab_size, spec.cfg.hidden_size)
        _check(name, tensor, expected, "the target's vocabulary x the head's hidden size")
        head.embed_tokens = nn.Embedding(*expected, _weight=tensor.to(head.fc.weight.dtype).to(head.fc.weight.device))
        filled[name] = {0}
        return
    module, _, leaf = name.rpartition(".")
    stem = module.rpartition(".")[2]
    if stem in _FUSED:
        fused, index = _FUSED[stem]
        target = f"{module.rpartition('.')[0]}.{fused}.{leaf}"
        param = params.get(target)
        if param is None:
            raise ValueError(f"{KEY}: unknown tensor {name} in the head's checkpoint")
        rows = _fused_rows(spec, fused, index, param.shape[0])
        expected = (rows.stop - rows.start, *param.shape[1:])
        _check(name, tensor, expected, _why(spec, name))
        with torch.no_grad():
            param[rows].copy_(tensor)
        filled.setdefault(target, set()).add(index)
        return
    param = params.get(name)
    if param is None:
        raise ValueError(f"{KEY}: unknown tensor {name} in the head's checkpoint (an {spec.kind} head has "
                         f"{', '.join(sorted(params))})")
    _check(name, tensor, tuple(param.shape), _why(spec, name))
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype) if name != "d2t" else tensor.long())
    filled[name] = {0}


def _fused_rows(spec: HeadSpec, fused: str, index: int, total: int) -> slice:
    cfg = spec.cfg
    if fused == "qkv_proj":
        sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
    else:
        sizes = (cfg.intermediate_size, cfg.intermediate_size)
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


def _why(spec: HeadSpec, name: str) -> str:
    if name.startswith("fc."):
        return (f"fc reads {'three of the target layers' if spec.kind == 'eagle3' else 'the token embedding and'} "
                f"the target's hidden states ({spec.target_hidden} each)")
    if name.startswith("self_attn.") and name.endswith("proj.weight") and "o_proj" not in name:
        return f"q, k and v read {spec.qkv_in} features"
    if name.startswith("lm_head") or name == "d2t":
        return f"a draft vocabulary of {spec.draft_vocab}"
    return "the head's config.json"


def _check(name: str, tensor: torch.Tensor, expected: tuple[int, ...], why: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{KEY}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected)} "
                         f"({why})")

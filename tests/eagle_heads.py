"""Random EAGLE heads in the public checkpoint layouts, for a target built by hf_models.

    build_eagle_head(path, target_dir, "eagle")    fc (+ bias) over [embedding; feature],
                                                  layers.0.* without input_layernorm
    build_eagle_head(path, target_dir, "eagle3")  fc over three layers' inputs, midlayer.*
                                                  with hidden_norm and 2H-wide q/k/v, norm,
                                                  lm_head over a draft vocabulary, d2t/t2d

Both write config.json (a LlamaConfig's keys, as the EAGLE repositories and vLLM read
them) and model.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def build_eagle_head(path: Path, target_dir: Path, kind: str, seed: int = 0, draft_vocab: int | None = None,
                     scale: float = 0.02, aux_layers: list[int] | None = None, **overrides) -> dict:
    """Write a random head for the target in `target_dir`; returns its config dict."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads = overrides.pop("num_attention_heads", target["num_attention_heads"])
    kv_heads = overrides.pop("num_key_value_heads", target.get("num_key_value_heads") or heads)
    head_dim = overrides.pop("head_dim", hidden // heads)
    inter = overrides.pop("intermediate_size", target["intermediate_size"])
    config = dict(
        architectures=["LlamaForCausalLMEagle3" if kind == "eagle3" else "EagleLlamaForCausalLM"],
        model_type="llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        rms_norm_eps=target.get("rms_norm_eps", 1e-6), rope_theta=target.get("rope_theta", 10000.0),
        max_position_embeddings=target.get("max_position_embeddings", 2048), tie_word_embeddings=False,
    )
    if kind == "eagle3":
        config["draft_vocab_size"] = draft_vocab or vocab
        config["target_hidden_size"] = hidden
        if aux_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux_layers
    config.update(overrides)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(hidden, generator=gen) * 0.1

    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    qkv_in = 2 * hidden if kind == "eagle3" else hidden
    tensors = {
        f"{prefix}self_attn.q_proj.weight": rand(heads * head_dim, qkv_in),
        f"{prefix}self_attn.k_proj.weight": rand(kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.v_proj.weight": rand(kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, inter),
        f"{prefix}post_attention_layernorm.weight": norm(),
    }
    if kind == "eagle":
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
        tensors["fc.bias"] = rand(hidden)
    else:
        layers = len(aux_layers) if aux_layers is not None else 3
        dv = config["draft_vocab_size"]
        tensors["fc.weight"] = rand(hidden, layers * hidden)
        tensors[f"{prefix}input_layernorm.weight"] = norm()
        tensors[f"{prefix}hidden_norm.weight"] = norm()
        tensors["norm.weight"] = norm()
        tensors["lm_head.weight"] = rand(dv, hidden) * 10
        keep = torch.sort(torch.randperm(vocab, generator=gen)[:dv]).values  # the draft vocabulary's target ids
        tensors["d2t"] = keep - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[keep] = True
        tensors["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return config

"""A seeded, randomly initialised Llama in Hugging Face format: what the offline
benchmarks (bench/engine/offline.py, bench/engine/parallel.py, bench/engine/sampled.py) and the cluster
benchmarks (bench/cluster/clusters.py) run on.

    ModelSpec --save_random_model(spec, dir, seed)--> dir/config.json, model.safetensors
                                                      (fp32, ids PAD 0, BOS 1, EOS 2)

torch and transformers load on first use (in `save_random_model`), not on import.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

FIRST_REGULAR_TOKEN = 3  # ids 0 (pad), 1 (bos) and 2 (eos) never appear in prompts
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class ModelSpec:
    """A Llama architecture; the defaults are a ~100M-parameter model."""

    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 4
    intermediate_size: int = 2048
    vocab_size: int = 32000
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of q, k, v, o, gate, up and down projections (no norms, no biases)."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * self.intermediate_size
        return attention + mlp

    @property
    def non_embedding_linear_params(self) -> int:
        return self.num_layers * self.linear_params_per_layer

    @property
    def total_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.non_embedding_linear_params + embeddings + norms


def save_random_model(spec: ModelSpec, path: Path, seed: int) -> None:
    """Save a seeded, randomly initialised fp32 Llama in Hugging Face format."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-5,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    del model
    gc.collect()


@contextmanager
def temporary_dir(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def decode_shapes(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, in, out) of each GEMM a decode step runs, fused as the loader fuses them."""
    h = spec.hidden_size
    return [
        ("qkv_proj", h, spec.q_size + 2 * spec.kv_size),
        ("o_proj", spec.q_size, h),
        ("gate_up_proj", h, 2 * spec.intermediate_size),
        ("down_proj", spec.intermediate_size, h),
        ("lm_head", h, spec.vocab_size),
    ]

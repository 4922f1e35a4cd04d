"""What a KV block's bytes mean: the layout every tier keys its blocks by, beside the
block hash.

    KVLayout(kv_dtype, kv_format, model_digest, block_size, shape)
        .digest   16 hex digits: a disk file's name starts with it, and its header
                  carries the whole layout, so a file of another model, dtype,
                  quantization or block size is never read as ours

A block hash names tokens (engine/hashing.py); the same tokens under another model
or KV dtype are other bytes, so a lower tier that outlives its process (the disk)
must know whose bytes a file holds. `model_digest` fingerprints the checkpoint
cheaply (its config and each weight file's size, first and last MiB) without
reading every weight.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

_SAMPLE = 1 << 20  # bytes read from each end of a weight file for its fingerprint


@dataclass(frozen=True)
class KVLayout:
    kv_dtype: str  # the pages' torch dtype: "float32", "float8_e4m3fn", ...
    kv_format: str  # the runner's: weight scheme, fp8 scales (model_runner.ModelRunner.kv_format)
    model_digest: str
    block_size: int
    shape: tuple[int, ...]  # one block across all layers: (layers, 2, block_size, kv_heads, head_dim)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _itemsize(self.kv_dtype)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "shape": list(self.shape)}, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(str(d["kv_dtype"]), str(d["kv_format"]), str(d["model_digest"]), int(d["block_size"]),
                   tuple(int(x) for x in d["shape"]))


def _itemsize(dtype_name: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def model_digest(model_dir: str | Path) -> str:
    """A fingerprint of a checkpoint: config.json's bytes, and each weight file's name,
    size and first and last MiB (a retrained or re-quantized model differs there)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"{path.name};{size};".encode())
        with path.open("rb") as f:
            h.update(f.read(_SAMPLE))
            if size > _SAMPLE:
                f.seek(max(_SAMPLE, size - _SAMPLE))
                h.update(f.read(_SAMPLE))
    return h.hexdigest()[:16]

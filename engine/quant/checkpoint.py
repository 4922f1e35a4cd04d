"""Pre-quantized checkpoints: what config.json's quantization_config declares, and each
format's tensors mapped onto the canonical storage (engine/quant/formats.py).

A `CheckpointFormat` answers, for a tensor name (without `model.`): is it one of a
quantized module's tensors (`owns`), which module and field (`split`), does a module
have all its tensors (`complete`), and what are they in canonical form (`to_canonical`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pdserve.engine.quant.config import WeightScheme


class CheckpointFormat(Protocol):
    scheme: WeightScheme

    def owns(self, name: str) -> bool: ...

    def split(self, name: str) -> tuple[str, str]: ...

    def complete(self, tensors: dict[str, torch.Tensor]) -> bool: ...

    def to_canonical(self, tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]: ...


def detect_format(config: dict[str, Any]) -> CheckpointFormat | None:
    """The format config.json declares; None for a full-precision checkpoint. Anything
    not supported is a ValueError naming the method and format."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported yet")

"""Attention backends behind one interface, chosen by name."""

from __future__ import annotations

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("torch", "triton")


def get_backend(name: str, device: str | None = None) -> AttentionBackend:
    """`auto` picks Triton on a GPU and the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device is not None and device.startswith("cuda") else "torch"
    if name == "torch":
        from pdserve.engine.attention.torch_ref import TorchAttention

        return TorchAttention()
    if name == "triton":
        from pdserve.engine.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention_backend: unknown {name!r}; choose one of {BACKENDS} or 'auto'")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]

"""An EAGLE head's state for one prompt, as it moves from the prefill worker that ran
the head over the prompt to the decode worker that drafts from it (engine/disagg.py,
kvtransfer/wire.py: it travels with the final message)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftLayout:
    """What an EAGLE head's state for one prompt is made of (both sides must agree:
    the head's digest is in the worker's kv_format, so different heads never pair)."""

    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    feature_size: int  # the target's feature per position (eagle3: three layers' width)

    @property
    def row_bytes(self) -> int:  # one position of the head's KV: K and V
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def feature_bytes(self) -> int:
        return self.feature_size * self.dtype.itemsize


@dataclass(frozen=True)
class DraftState:
    """An EAGLE head's state at the end of a prompt of P tokens, prefilled elsewhere:
    its KV of positions base .. P-2 (`kv` [P-1-base, 2, kv_heads, head_dim], each
    row fed the target's feature and the prompt's next token) and the target's feature
    at P-1 (`feature` [F]), which the first decoded token's row needs. With it the
    decode worker's head drafts exactly as after a local prefill."""

    base: int
    kv: torch.Tensor
    feature: torch.Tensor

    def check(self, layout: DraftLayout, num_prompt_tokens: int) -> None:
        """ValueError naming what does not fit (a peer's bytes: never trusted)."""
        rows = num_prompt_tokens - 1 - self.base
        if not 0 <= self.base <= num_prompt_tokens - 1:
            raise ValueError(f"draft.base: {self.base} is not a position of the {num_prompt_tokens}-token prompt")
        want = (rows, 2, layout.num_kv_heads, layout.head_dim)
        if tuple(self.kv.shape) != want or self.kv.dtype != layout.dtype:
            raise ValueError(f"draft.kv: {self.kv.dtype} {tuple(self.kv.shape)}, the head holds {layout.dtype} {want}")
        if tuple(self.feature.shape) != (layout.feature_size,) or self.feature.dtype != layout.dtype:
            raise ValueError(f"draft.feature: {self.feature.dtype} {tuple(self.feature.shape)}, the head reads "
                             f"{layout.dtype} ({layout.feature_size},)")

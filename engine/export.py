"""The prefill side's per-layer hook: which exported tokens a layer has just written.

    step(): schedule -> forward pass, layer 0 .. L-1
                            |  after each layer
                            v
            layer_hook(layer, [ExportSlice(request, start, end, block ids)])

Only requests added with `export_kv=True` appear in a slice; a batch without one
calls nothing. The hook runs on the engine thread, inside the forward pass: it may
read the slices' pages (they are final for that layer) and must not block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request


@dataclass(frozen=True)
class ExportSlice:
    """Prefill side: KV of tokens [start, end) of an exported request was just written."""

    request_id: str
    start: int
    end: int
    block_ids: list[int]


LayerHook = Callable[[int, list[ExportSlice]], None]


def layer_callback(
    hook: LayerHook | None, scheduled: list[tuple[Request, int]], kv: KVCacheManager
) -> Callable[[int], None] | None:
    """What the forward pass calls after each layer: the hook, told which exported
    tokens that layer has written (None when nothing in the batch is exported)."""
    if hook is None:
        return None
    slices = [
        ExportSlice(r.request_id, r.num_computed_tokens, r.num_computed_tokens + n, kv.block_ids(r.request_id))
        for r, n in scheduled
        if r.export_kv
    ]
    if not slices:
        return None
    return lambda layer: hook(layer, slices)

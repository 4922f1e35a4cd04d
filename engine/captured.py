"""The captured decode step: the model's decode forward compiled once per batch bucket.

A pure decode step (every sequence computes one token and wants its logits) is the
step a serving engine runs most, and on the eager path a third of it is Python and
per-operator dispatch around small kernels. Here the model's own forward, over a
`DecodeMeta` (tensors only) and the `CapturedAttention` backend, goes through
`torch.compile` (Inductor, its C++ backend on a CPU; `freezing`: the weights become
constants, prepacked for oneDNN/MKL, and constant work is folded) once per bucket size
at start-up. A step of n sequences runs in the smallest bucket B >= n, its inputs
copied into that bucket's persistent buffers and padded (padded rows write no KV and
their logits are dropped); a bigger batch, a prefill, a mixed or speculative step, a
layer hook or a feature capture runs eagerly.

Each bucket gets its own copy of the step function's code, so its compiled graph is
the only entry dynamo caches for it: no recompilation across buckets or engines in
one process, and guards checked once per step.

The cost is memory: Inductor packs the weights for one row count, so each bucket's
graph holds its own packed copy of every linear weight (measured: +430 MB a bucket on
bench.offline's 400 MB model), beside the plain ones the eager path (prefill) keeps.
So capture is asked for, bucket by bucket (`EngineConfig.decode_capture_sizes`), and
`added_bytes` counts it in the memory plan. Outputs match the eager path's to the last
bits of a float32 sum (another GEMM kernel, fused element-wise code), not bit for bit.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._inductor import config as inductor_config

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.attention.decode_op import CapturedAttention, DecodeMeta

log = logging.getLogger(__name__)



def available(device: torch.device, quantized: bool) -> bool:
    """Where a captured step applies: a CPU (Inductor's C++ backend; a GPU's CUDA-graph
    capture is not built), full-precision weights (the quantized kernels stay eager)."""
    return device.type == "cpu" and not quantized


def _step_of(model: nn.Module, backend: AttentionBackend) -> Callable[..., torch.Tensor]:
    """The decode step over `model`, which it reads from its closure: freezing folds only
    weights the graph reaches as module attributes, not through an argument."""

    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, kv_rows: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, info: torch.Tensor,
                    block_size: int) -> torch.Tensor:
        meta = DecodeMeta(kv_rows, block_tables, seq_lens, info, block_size)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return model(input_ids, positions, kv_cache, meta, backend, rows)

    return decode_step


def _own_copy(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: dynamo caches compiled graphs per code object."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class _Bucket:
    size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    info: torch.Tensor
    step: Callable


@dataclass(frozen=True)
class DecodeInputs:
    """One step's sequences, host side: token, position, K row, block ids, length after."""

    tokens: list[int]
    positions: list[int]
    kv_rows: list[int]
    block_ids: list[list[int]]
    seq_lens: list[int]


class CapturedDecode:
    def __init__(self, model: nn.Module, sizes: Sequence[int], block_size: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)
        self.device = device
        self.backend = CapturedAttention()
        self.buckets: dict[int, _Bucket] = {}
        self.compile_seconds = 0.0
        self.steps = 0  # steps run captured (the rest of the engine's steps ran eagerly)

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    @torch.inference_mode()
    def compile(self, kv_cache: torch.Tensor) -> float:
        """Compile every bucket, each run once on an empty batch (writes nothing); returns seconds."""
        start = time.perf_counter()
        for size in self.sizes:
            t0 = time.perf_counter()
            bucket = self._bucket(size)
            with inductor_config.patch(freezing=True):
                self._call(bucket, kv_cache)
            self.buckets[size] = bucket
            log.info("captured decode step: batch %d compiled in %.1f s", size, time.perf_counter() - t0)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def _bucket(self, size: int) -> _Bucket:
        dev = self.device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        step = torch.compile(_own_copy(_step_of(self.model, self.backend), f"decode_step_b{size}"), fullgraph=True, dynamic=False)
        info = torch.tensor([0, 1], dtype=torch.long, device=dev)
        return _Bucket(size, zeros(size), zeros(size), zeros(size), zeros(size, self.width, dtype=torch.int32),
                       torch.ones(size, dtype=torch.long, device=dev), info, step)

    def _call(self, b: _Bucket, kv_cache: torch.Tensor) -> torch.Tensor:
        return b.step(b.input_ids, b.positions, kv_cache, b.kv_rows, b.block_tables,
                      b.seq_lens, b.info, self.block_size)

    def bucket_for(self, n: int) -> int | None:
        """The smallest compiled bucket that holds n sequences (None: run eagerly)."""
        return next((s for s in self.sizes if s >= n and s in self.buckets), None)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of a pure decode step of n <= max_size sequences."""
        n = len(inputs.tokens)
        size = self.bucket_for(n)
        if size is None:
            raise ValueError(f"captured decode: no bucket holds {n} sequences (sizes {self.sizes})")
        b = self.buckets[size]
        pad = size - n
        b.input_ids.copy_(torch.tensor(inputs.tokens + [0] * pad))
        b.positions.copy_(torch.tensor(inputs.positions + [0] * pad))
        b.kv_rows.copy_(torch.tensor(inputs.kv_rows + [0] * pad))
        b.seq_lens.copy_(torch.tensor(inputs.seq_lens + [1] * pad))
        width = max(len(ids) for ids in inputs.block_ids)
        if width > self.width:
            raise ValueError(f"captured decode: a sequence holds {width} blocks, more than max_model_len allows")
        b.block_tables[:n, :width] = torch.tensor([ids + [0] * (width - len(ids)) for ids in inputs.block_ids],
                                                  dtype=torch.int32)
        b.info.copy_(torch.tensor([n, max(inputs.seq_lens)]))
        self.steps += 1
        return self._call(b, kv_cache)[:n]


def added_bytes(model: nn.Module, buckets: int) -> int:
    """Bytes `buckets` compiled graphs' prepacked weights add: each packs every linear
    layer's weight and a tied LM head's (the embedding table, packed as a linear weight)."""
    total = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    if getattr(model, "lm_head", None) is None and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
        weight = model.embed_tokens.weight
        total += weight.numel() * weight.element_size()
    return total * buckets

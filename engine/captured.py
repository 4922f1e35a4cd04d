"""The captured decode step: the model's decode forward compiled once per batch bucket.

A pure decode step (every sequence computes one token and wants its logits) is the
step a serving engine runs most, and on the eager path a third of it is Python and
per-operator dispatch around small kernels. Here the model's own forward, over a
`DecodeMeta` (tensors only) and the `CapturedAttention` backend, goes through
`torch.compile` (Inductor; its C++ backend on a CPU) once per bucket size at start-up:
the element-wise work between the GEMMs (norms, residual adds, rotary, SiLU-and-multiply,
padding) is fused into a few C++ loops and the per-operator Python is gone. A step of n
sequences runs in the smallest bucket B >= n, its inputs copied into that bucket's
persistent buffers and padded (padded rows write no KV and their logits are dropped);
a bigger batch, a prefill, a mixed or speculative step, a layer hook or a feature
capture runs eagerly.

The GEMMs stay the eager path's: oneDNN-prepacked layers (engine/prepacked.py) are
called through `pdserve::prepacked_linear`, so every bucket shares the weights the eager
path holds (no copy per graph), and the smaller, plain layers are traced as they are.

Each bucket gets its own copy of the step function's code, so its compiled graph is
the only entry dynamo caches for it: no recompilation across buckets or engines in
one process, and guards checked once per step. Inductor caches its compiled code on
disk (TORCHINDUCTOR_CACHE_DIR), so a restart compiles faster.

Outputs match the eager path's to the last bits of a float32 sum (fused element-wise
code may round in another order), not bit for bit.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionBackend, kv_rows
from pdserve.engine.attention.decode_op import CapturedAttention, DecodeMeta, DecodeStep

log = logging.getLogger(__name__)


def available(device: torch.device, quantized: bool) -> bool:
    """Where a captured step applies: a CPU (Inductor's C++ backend; a GPU's CUDA-graph
    capture is not built), full-precision weights (the quantized kernels stay eager)."""
    return device.type == "cpu" and not quantized


def _step_of(model: nn.Module, backend: AttentionBackend, block_size: int) -> Callable[..., torch.Tensor]:
    """The decode step over `model` (a closure: the graph reads its weights as module attributes)."""

    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                    step: DecodeStep) -> torch.Tensor:
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return model(input_ids, positions, kv_cache, DecodeMeta(step, block_size), backend, rows)

    return decode_step


def _own_copy(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: dynamo caches compiled graphs per code object."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class _Bucket:
    """A bucket's compiled step and its persistent inputs (the rest is in the `DecodeStep`)."""

    size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    step: Callable


@dataclass(frozen=True)
class DecodeInputs:
    """One step's sequences, host side: token, position, KV slot, block ids, length after."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
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
        self.state = DecodeStep()  # what every layer's attention reads, refilled each step
        self.buckets: dict[int, _Bucket] = {}
        self.compile_seconds = 0.0
        self.steps = 0  # steps run captured (the rest of the engine's steps ran eagerly)

    @torch.inference_mode()
    def compile(self, kv_cache: torch.Tensor) -> float:
        """Compile every bucket, each run once on an empty batch (writes nothing); returns seconds."""
        start = time.perf_counter()
        for size in self.sizes:
            t0 = time.perf_counter()
            bucket = self._bucket(size)
            self._call(bucket, kv_cache)
            self.buckets[size] = bucket
            log.info("captured decode step: batch %d compiled in %.1f s", size, time.perf_counter() - t0)
        self.compile_seconds = time.perf_counter() - start
        log.info("captured decode step: batch sizes %s compiled in %.1f s", list(self.sizes), self.compile_seconds)
        return self.compile_seconds

    def _bucket(self, size: int) -> _Bucket:
        # No guards: the bucket's inputs keep their shapes and dtypes, the model is not
        # changed after compiling, and a new KV cache compiles new buckets (compile()).
        step = torch.compile(_own_copy(_step_of(self.model, self.backend, self.block_size), f"decode_step_b{size}"),
                             fullgraph=True, dynamic=False,
                             options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
        zeros = torch.zeros(size, dtype=torch.long, device=self.device)
        return _Bucket(size, zeros, zeros.clone(), step)

    def _call(self, b: _Bucket, kv_cache: torch.Tensor) -> torch.Tensor:
        return b.step(b.input_ids, b.positions, kv_cache, self.state)

    def bucket_for(self, n: int) -> int | None:
        """The smallest compiled bucket that holds n sequences (None: run eagerly)."""
        return next((s for s in self.sizes if s >= n and s in self.buckets), None)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of a pure decode step of n sequences (at most the largest size)."""
        n = len(inputs.tokens)
        size = self.bucket_for(n)
        if size is None:
            raise ValueError(f"captured decode: no bucket holds {n} sequences (sizes {self.sizes})")
        width = max(len(ids) for ids in inputs.block_ids)
        if width > self.width:
            raise ValueError(f"captured decode: a sequence holds {width} blocks, more than max_model_len allows")
        b = self.buckets[size]
        pad = size - n
        b.input_ids.copy_(torch.tensor(inputs.tokens + [0] * pad))
        b.positions.copy_(torch.tensor(inputs.positions + [0] * pad))
        dev = self.device
        tables = torch.tensor([ids + [0] * (width - len(ids)) for ids in inputs.block_ids], device=dev)
        self.state.set(kv_rows(torch.tensor(inputs.slots, device=dev), self.block_size), tables,
                       torch.tensor(inputs.seq_lens, device=dev))
        self.steps += 1
        return self._call(b, kv_cache)[:n]

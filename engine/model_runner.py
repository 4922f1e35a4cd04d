"""Owns the model weights and the KV tensor; turns a scheduled batch into logits.

KV layout, one tensor per worker:

    kv_cache[layer, block, 0 | 1, slot, kv_head, head_dim]      (0 = K, 1 = V)

so one block of one layer (K and V together) is a contiguous page, which is what
kvtransfer ships.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pdserve.engine import captured, prepacked
from pdserve.engine.attention import AttentionMetadata, get_backend
from pdserve.engine.attention.base import is_fp8, kv_rows
from pdserve.engine.captured import CapturedDecode, DecodeInputs
from pdserve.engine.config import ModelConfig
from pdserve.engine.memory import kv_bytes_per_token
from pdserve.engine.model.llama import FeatureCapture
from pdserve.engine.model.loader import load_model
from pdserve.engine.quant.apply import weight_bytes
from pdserve.engine.quant.config import kv_torch_dtype
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.sampling_params import SamplingParams


class Sequence(Protocol):
    """What a forward pass reads of a sequence: a `Request`, or a draft model's view of one."""

    token_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(frozen=True)
class BatchItem:
    """`num_tokens` tokens of `request` computed this step, from its first uncomputed one.
    With `drafts` (speculative decoding) those follow its known tokens: the step computes
    up to the last draft and scores every position from its last known token on."""

    request: Sequence
    num_tokens: int  # tokens computed this step
    block_ids: list[int]
    drafts: tuple[int, ...] = ()


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return kv_bytes_per_token(cfg, dtype) * block_size


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        prepack: bool = False,
        capture_sizes: tuple[int, ...] = (),
    ) -> None:
        """`prepack`: hold the full-precision linear layers in oneDNN's packed layout where
        that applies (engine/prepacked.py: a CPU, fp32 or bf16); off, they stay `nn.Linear`.
        `capture_sizes`: compile the pure decode step for these batch sizes once the KV
        cache is allocated (engine/captured.py), where that applies; the graphs share the
        eager path's weights, prepacked or not."""
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.dtype = dtype
        # the pages' dtype: the model's, or float8 (--kv-cache-dtype)
        self.kv_dtype = kv_torch_dtype(kv_cache_dtype, dtype)
        self.model = load_model(model_dir, cfg, dtype, device, max_model_len, quantization, self.kv_dtype)
        quantized = any(isinstance(m, QuantLinear) for m in self.model.modules())
        self.captured: CapturedDecode | None = None
        if capture_sizes and captured.available(device, quantized):
            self.captured = CapturedDecode(self.model, capture_sizes, block_size, max_model_len, device)
        self.prepacked = 0
        if prepack and prepacked.available(device, dtype):
            self.prepacked = prepacked.prepack_linears(self.model, prepacked.tied_head(self.model))
        self.backend = get_backend(attention_backend, str(device))
        self.kv_cache = torch.empty(0)

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model) + prepacked.packed_bytes(self.model)

    @property
    def weight_scheme(self) -> str:
        layer = next((m for m in self.model.modules() if isinstance(m, QuantLinear)), None)
        return layer.scheme.label if layer is not None else str(self.dtype).removeprefix("torch.")

    @property
    def kv_format(self) -> str:
        """What a KV page's bytes mean beyond its shape and dtype, for the pairing check:
        the weights' scheme (K and V come out of the quantized projections) and, for a
        float8 cache, every layer's (k_scale, v_scale)."""
        text = f"weights={self.weight_scheme}"
        if self.model.rope.factors is not None:  # longrope's set follows max_model_len (engine/model/rope.py)
            text += f";longrope={self.model.rope.factors}"
        if is_fp8(self.kv_dtype):
            scales = ",".join(f"{k!r}/{v!r}" for k, v in (layer.self_attn.kv_scales for layer in self.model.layers))
            text += f";kv_scales={hashlib.sha256(scales.encode()).hexdigest()[:16]}"
        return text

    @property
    def kv_layout(self) -> str:
        """The pages' dtype and `kv_format`: what two workers exchanging KV must share."""
        return f"{str(self.kv_dtype).removeprefix('torch.')};{self.kv_format}"

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.cfg
        shape = (cfg.num_layers, num_blocks, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if self.captured is not None and num_blocks > 0:
            # the graphs are specialised to the cache's shape: compiled once it is final
            self.captured.compile(self.kv_cache)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): the copy half of copy-on-write."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            kv = self.kv_cache.view(torch.uint8) if is_fp8(self.kv_dtype) else self.kv_cache
            kv[:, dst] = kv[:, src]

    @torch.inference_mode()
    def execute(
        self, batch: list[BatchItem], on_layer: Callable[[int], None] | None = None,
        capture: FeatureCapture | None = None,
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Run one step; returns logits [R, vocab] and, per batch item, its (first row, rows).

        An item gets one row, for its last token, when it reaches the end of its known
        tokens (a prefill chunk in the middle of a prompt gets none); an item that asked
        for prompt logprobs gets a row for every prompt token it computes; an item with
        K drafts gets K+1 rows, for its last known token and each draft. With
        `capture`, its features hold every input row, in batch order (item i's rows are
        its `num_tokens` (+ drafts) tokens from its first uncomputed position on).
        """
        if self.captured is not None and on_layer is None and capture is None:
            inputs = self._decode_inputs(self.captured, batch)
            if inputs is not None:
                return self.captured.run(inputs, self.kv_cache).float(), [(i, 1) for i in range(len(batch))]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        spans: list[tuple[int, int]] = []
        for item in batch:
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            first = len(input_ids)
            tokens = req.token_ids + list(item.drafts) if item.drafts else req.token_ids
            if item.drafts and end != len(tokens):
                raise ValueError(f"batch: {len(item.drafts)} drafts must be scored to the last one")
            input_ids += tokens[start:end]
            pos = range(start, end)
            positions += pos
            slots += [item.block_ids[p // bs] * bs + p % bs for p in pos]
            q_lens.append(item.num_tokens)
            seq_lens.append(end)
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                rows = list(range(first, len(input_ids)))
            elif item.drafts:
                rows = list(range(len(input_ids) - len(item.drafts) - 1, len(input_ids)))
            else:
                rows = [len(input_ids) - 1] if end == req.num_tokens else []
            spans.append((len(logits_rows), len(rows)))
            logits_rows += rows
        meta = self._metadata(batch, slots, q_lens, seq_lens)
        dev = self.device
        logits = self.model(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            self.kv_cache,
            meta,
            self.backend,
            torch.tensor(logits_rows, device=dev, dtype=torch.long),
            on_layer,
            capture,
        )
        return logits.float(), spans

    def _decode_inputs(self, graphs: CapturedDecode, batch: list[BatchItem]) -> DecodeInputs | None:
        """`batch` as a captured step's inputs, if it is a pure decode step that fits a
        bucket: every item computes its one next token and wants only that token's logits."""
        if not batch or graphs.bucket_for(len(batch)) is None:
            return None
        bs = self.block_size
        inputs = DecodeInputs([], [], [], [], [])
        for item in batch:
            req, pos = item.request, item.request.num_computed_tokens
            if (item.num_tokens != 1 or item.drafts or pos + 1 != req.num_tokens
                    or (req.sampling_params.prompt_logprobs is not None and pos < req.num_prompt_tokens)):
                return None
            inputs.tokens.append(req.token_ids[pos])
            inputs.positions.append(pos)
            inputs.slots.append(item.block_ids[pos // bs] * bs + pos % bs)
            inputs.block_ids.append(item.block_ids[: pos // bs + 1])
            inputs.seq_lens.append(pos + 1)
        return inputs

    def _metadata(self, batch: list[BatchItem], slots, q_lens, seq_lens) -> AttentionMetadata:
        return attention_metadata([item.block_ids for item in batch], slots, q_lens, seq_lens, self.block_size,
                                  self.device)


def attention_metadata(
    block_ids: list[list[int]], slots: list[int], q_lens: list[int], seq_lens: list[int], block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """A step's attention metadata (attention/base.py): sequence b's `block_ids[b]`, its
    `q_lens[b]` new tokens written at `slots`, `seq_lens[b]` tokens in cache after."""
    width = max(len(ids) for ids in block_ids)
    tables = torch.zeros((len(block_ids), width), dtype=torch.int32)
    for i, ids in enumerate(block_ids):
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        kv_rows=kv_rows(slot_mapping, block_size),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=tuple(q_lens),
        seq_lens_cpu=tuple(seq_lens),
        query_start_loc_cpu=tuple(qsl),
    )

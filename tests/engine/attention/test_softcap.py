"""Attention logit soft-capping (Gemma 2): the torch backend against transformers'
eager op order on every path (fresh prompt, chunk over cached context, batched
decodes), with and without a sliding window; the Triton kernels (the interpreter on
a CPU) against the torch backend."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.engine.attention.triton_backend import TritonAttention
from pdserve.engine.model_runner import attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 8
TABLES = [[5, 2, 7], [0, 3, 6, 1], [4]]
# (query lens, seq lens after the step): fresh prompts, a chunk beside decodes, decodes
STEPS = [([13, 20, 5], [13, 20, 5]), ([1, 6, 1], [14, 26, 6]), ([1, 1, 1], [15, 27, 7])]


def metadata(q_lens: list[int], seq_lens: list[int]):
    slots = [TABLES[b][p // BLOCK] * BLOCK + p % BLOCK
             for b, (ql, n) in enumerate(zip(q_lens, seq_lens)) for p in range(n - ql, n)]
    return attention_metadata(TABLES, slots, q_lens, seq_lens, BLOCK, torch.device("cpu"))


def eager(q, k, v, scale: float, cap: float, window: int | None) -> torch.Tensor:
    """transformers' Gemma 2 eager attention of the last len(q) of len(k) positions."""
    group = HEADS // KV_HEADS
    qt = q.transpose(0, 1)
    kt, vt = (x.repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
    scores = torch.tanh(torch.matmul(qt, kt.transpose(1, 2)) * scale / cap) * cap
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = scores + torch.where(allowed, 0.0, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), vt).transpose(0, 1)


@pytest.mark.parametrize("window", [None, 9])
def test_torch_softcap_matches_eager_on_every_path(window):
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(8, 2, BLOCK, KV_HEADS, HEAD_DIM)
    history: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in TABLES]
    scale, cap = HEAD_DIM**-0.5, 1.5
    for q_lens, seq_lens in STEPS:
        t = sum(q_lens)
        q, k, v = (torch.randn(t, h, HEAD_DIM, generator=gen) * 3 for h in (HEADS, KV_HEADS, KV_HEADS))
        out = TorchAttention().forward(q, k, v, cache, metadata(q_lens, seq_lens), scale, window, softcap=cap)
        start = 0
        for b, n in enumerate(q_lens):
            history[b][0].append(k[start : start + n])
            history[b][1].append(v[start : start + n])
            want = eager(q[start : start + n], torch.cat(history[b][0]), torch.cat(history[b][1]), scale, cap, window)
            torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
            start += n
        uncapped = TorchAttention().forward(q, k, v, cache.clone(), metadata(q_lens, seq_lens), scale, window)
        assert (out - uncapped).abs().max() > 1e-2  # the cap bites at these scores


@pytest.mark.parametrize("window", [None, 9])
def test_triton_softcap_matches_torch(window):
    gen = torch.Generator().manual_seed(1)
    caches = {name: torch.zeros(8, 2, BLOCK, KV_HEADS, HEAD_DIM) for name in ("torch", "triton")}
    backends = {"torch": TorchAttention(), "triton": TritonAttention()}
    for q_lens, seq_lens in STEPS:  # the last step has one query each: the decode kernel
        meta = metadata(q_lens, seq_lens)
        q, k, v = (torch.randn(sum(q_lens), h, HEAD_DIM, generator=gen) * 3 for h in (HEADS, KV_HEADS, KV_HEADS))
        outs = {name: backends[name].forward(q, k, v, caches[name], meta, HEAD_DIM**-0.5, window, softcap=1.5)
                for name in backends}
        torch.testing.assert_close(outs["triton"], outs["torch"], rtol=2e-5, atol=2e-5)

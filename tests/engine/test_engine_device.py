"""Device safety without a GPU: the model, sampler and beam paths on `meta` tensors.

A meta tensor has a device but no data. Every op on it checks devices as on a GPU, so a
tensor created on the CPU and mixed in raises "Tensor on device cpu is not on the
expected device meta", and a host sync (`.tolist()`, `.item()`, `int(t)`) raises
"Cannot copy out of meta tensor". What must run on the device runs here end to end;
only the host bookkeeping after `SampledTensors.to_host` / `BeamSearch.advance` is left.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.beam import BeamSearch
from pdserve.engine.config import ModelConfig
from pdserve.engine.forking import Forker
from pdserve.engine.group import SequenceGroup
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.model_runner import BatchItem, ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sampler import (
    Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, mask_early_stop, sample_inverse_cdf,
)
from pdserve.engine.sampling_params import SamplingParams

META = torch.device("meta")
VOCAB = 4096


def seq(rid: str, output: list[int] = (), **params) -> Request:
    r = Request(rid, [5, 6, 7, 5], SamplingParams(**params), 16, eos_token_ids=(1,))
    for t in output:
        r.append_token(t)
    return r


MIX = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3, logprobs=3),
    dict(temperature=0.8, top_p=0.9, seed=3),
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.0, top_k=20, top_p=0.5, min_p=0.05, seed=1),
    dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4, stop_token_ids=(9,)),
    dict(temperature=1.0, min_p=0.2, logprobs=5),
]


def test_model_forward_runs_on_the_device():
    """Mixed batch (decodes batched, a chunked prefill, a fresh prefill) through every
    layer and the attention backend: no CPU tensor, no per-layer host sync."""
    runner = ModelRunner(DEFAULT_MODEL, ModelConfig.from_dir(DEFAULT_MODEL), torch.float32, META, 16, 256, "torch")
    runner.allocate_kv_cache(8)
    reqs = [Request(f"r{i}", [5] * (20 + i), SamplingParams(prompt_logprobs=1 if i == 2 else None), 16) for i in range(4)]
    for r, done in zip(reqs, (19, 20, 4, 0)):
        r.num_computed_tokens = done
    batch = [BatchItem(reqs[0], 1, [0, 1]), BatchItem(reqs[1], 1, [2, 3]), BatchItem(reqs[2], 18, [4, 5]),
             BatchItem(reqs[3], 23, [6, 7])]
    logits, spans = runner.execute(batch)
    assert logits.device == META and logits.shape == (1 + 1 + 18 + 1, VOCAB)
    assert spans == [(0, 1), (1, 1), (2, 18), (20, 1)]
    runner.copy_blocks([(0, 7)])


def test_sampler_runs_on_the_device():
    requests = [seq(f"s{i}", output=[9, 11], **p) for i, p in enumerate(MIX)]
    sampled = Sampler().sample(torch.empty((len(requests), VOCAB), device=META), requests)
    assert sampled.token_ids.device == META and sampled.token_ids.shape == (len(requests),)
    assert sampled.logprobs.device == META
    assert sampled.top_ids.device == META and sampled.top_ids.shape == (len(requests), 5)


@pytest.mark.parametrize("rows", [[0], [1], [0, 1, 2]])
def test_each_sampling_stage_stays_on_the_device(rows):
    requests = [seq(f"s{i}", output=[9], **MIX[i + 4]) for i in range(3)]
    requests = [requests[i] for i in rows]
    logits = torch.empty((len(requests), VOCAB), device=META)
    for out in (
        apply_penalties(logits, requests),
        mask_early_stop(logits, requests),
        apply_top_k_top_p(logits, [r.sampling_params.top_k for r in requests], [r.sampling_params.top_p for r in requests]),
        apply_min_p(logits, [r.sampling_params.min_p for r in requests]),
    ):
        assert out.device == META and out.shape == logits.shape
    tokens = sample_inverse_cdf(logits.softmax(-1), torch.empty(len(requests), dtype=torch.float64, device=META))
    assert tokens.device == META and tokens.shape == (len(requests),)


def test_beam_step_runs_on_the_device():
    """The beam path's device half: log-probs, repetition penalty, min_tokens mask, the
    search's candidates."""
    params = SamplingParams(beam_width=3, n=2, max_tokens=8, min_tokens=2, repetition_penalty=1.2, stop_token_ids=(9,))
    beams = [Request(f"b{i}", [5, 6, 7], params, 16, eos_token_ids=(1,)) for i in range(3)]
    beam = BeamSearch(params, 3, (1, 9))
    group = SequenceGroup("b", params, [5, 6, 7], beams, beam=beam)
    log_probs = None
    for b in beams:
        log_probs = Forker.beam_log_probs(group, b, torch.empty(VOCAB, device=META))
    assert log_probs is not None and log_probs.device == META and log_probs.shape == (3, VOCAB)
    top_lp, top_idx = beam.candidates(log_probs)
    assert top_lp.device == META and top_idx.device == META and top_idx.shape == (3 * 3,)


def test_beam_host_half_matches_the_whole_step():
    """`step` is exactly `candidates` (device) then `advance` (host)."""
    params = SamplingParams(beam_width=3, max_tokens=5)
    log_probs = torch.log_softmax(torch.randn((1, 50), generator=torch.Generator().manual_seed(0)), -1)
    whole, split = BeamSearch(params, 4, (1,)), BeamSearch(params, 4, (1,))
    a = whole.step(log_probs, [[]])
    lp, idx = split.candidates(log_probs)
    b = split.advance(lp, idx, 50, [[]])
    assert a == b and torch.equal(whole.running_scores, split.running_scores)

"""Sampler pieces against direct computations on known logits."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, mask_early_stop
from pdserve.engine.sampling_params import SamplingParams

NEG = float("-inf")


def req(tokens: list[int], output: list[int] = (), **params) -> Request:
    r = Request("r", list(tokens), SamplingParams(**params), 4, eos_token_ids=(0,))
    for t in output:
        r.append_token(t)
    return r


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p(logits, [2], [1.0])
    assert out.tolist() == [[NEG, 5.0, NEG, 4.0, NEG]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :]
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the two most likely tokens remain
    out = apply_top_k_top_p(logits, [0], [0.7])
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    # p = 0.5 exactly: the first token alone reaches it
    out = apply_top_k_top_p(logits, [0], [0.5])
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]


def test_top_k_and_top_p_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, [3, 0], [1.0, 0.6])
    probs = torch.softmax(logits[1], -1)
    expected_second = probs.cumsum(0) - probs < 0.6
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]
    assert torch.isfinite(out[1]).tolist() == expected_second.tolist()


def test_min_p_scales_with_the_top_probability():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    out = apply_min_p(probs.log()[None, :], [0.2])  # threshold 0.12
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    r = req([0, 1], output=[3], repetition_penalty=2.0)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 1.0, 1.5]]


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros((1, 5))
    r = req([4, 4], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[0.0, -1.0, -0.75, 0.0, 0.0]]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros((1, 5))
    r = req([3], output=[4], min_tokens=3, stop_token_ids=[2])
    out = mask_early_stop(logits, [r])
    assert out[0].tolist() == [NEG, 0.0, NEG, 0.0, 0.0]


def test_logprobs_report_top_k_and_chosen():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    result = Sampler()(logits, [req([1], temperature=0.0, logprobs=2)])
    expected = torch.log_softmax(logits[0], -1)
    assert result.token_ids == [3]
    assert result.logprobs[0] == pytest.approx(float(expected[3]))
    assert result.top_logprobs[0] == pytest.approx({3: float(expected[3]), 2: float(expected[2])})


def test_sampled_distribution_matches_softmax_chi_square():
    """Seeds 0..N-1 on fixed logits: first-token counts against softmax(logits / T)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    temperature, trials = 0.7, 3000
    sampler = Sampler()
    counts = torch.zeros(6)
    for seed in range(trials):
        r = req([1], temperature=temperature, seed=seed)
        counts[sampler(logits, [r]).token_ids[0]] += 1
    expected = torch.softmax(logits[0] / temperature, -1) * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(5 / 2), torch.tensor(chi2 / 2)))
    assert p_value > 0.001, (counts.tolist(), expected.tolist(), chi2)


def test_bad_parameters_name_the_field():
    for kwargs, field in [
        (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"), (dict(n=0), "n"),
        (dict(beam_width=2, n=3), "n"), (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(stop=[""]), "stop"),
        (dict(early_stopping="sometimes"), "early_stopping"), (dict(beam_width=0), "beam_width"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**kwargs)
    assert math.isclose(SamplingParams(top_k=-1).top_k, 0)

"""Verification rules: greedy and seeded against spec-off sampling, the rejection sampler
against the target distribution (chi-square, fixed seeds)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, apply_penalties, mask_early_stop, sampling_probs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.verify import (
    accept_greedy, accept_matching, accept_rejection, accept_seeded, rejection_sample, seeded_uniforms,
)

VOCAB = 6


# -- greedy ------------------------------------------------------------------------------


@pytest.mark.parametrize(("draft", "argmax", "emitted"), [
    ([5, 4, 3], [5, 4, 3, 2], [5, 4, 3, 2]),  # all accepted, then the bonus token
    ([5, 4, 3], [5, 1, 3, 2], [5, 1]),  # the target's own token at the first mismatch
    ([5, 4, 3], [0, 4, 3, 2], [0]),  # nothing accepted: one token, as without speculation
    ([], [4], [4]),  # K = 0
])
def test_greedy(draft, argmax, emitted):
    assert accept_greedy(draft, argmax) == emitted
    assert accept_greedy(draft, torch.tensor(argmax)) == emitted


def test_greedy_needs_k_plus_one_positions():
    with pytest.raises(ValueError, match="2 drafts need 3 target positions, got 2"):
        accept_matching([1, 2], [1, 2])


# -- seeded: the same tokens as spec-off sampling -----------------------------------------


def target_logits(history: list[int]) -> torch.Tensor:
    """A deterministic stand-in for the target model: logits that depend on the whole history."""
    digest = hashlib.sha256(repr(history).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(VOCAB, generator=g) * 2.0


PARAMS = dict(seed=1234, temperature=0.9, top_k=5, top_p=0.95, repetition_penalty=1.3,
              presence_penalty=0.4, frequency_penalty=0.2, min_tokens=3, max_tokens=200)


def request_at(history: list[int], prompt: list[int], params: SamplingParams, sample_index: int) -> Request:
    r = Request("r", list(prompt), params, 4, eos_token_ids=(0,), sample_index=sample_index)
    for t in history[len(prompt):]:
        r.append_token(t)
    return r


def spec_off(prompt: list[int], params: SamplingParams, sample_index: int, n: int) -> list[int]:
    r = request_at(list(prompt), prompt, params, sample_index)
    sampler = Sampler()
    for _ in range(n):
        r.append_token(int(sampler.sample(target_logits(r.token_ids)[None], [r]).token_ids[0]))
    return r.output_token_ids


def pipeline_probs(history: list[int], prompt: list[int], params: SamplingParams, sample_index: int) -> torch.Tensor:
    """The target's row after history, through the sampler's full pipeline (penalties over
    the history including earlier drafts, min_tokens, temperature, top-k/p, min-p)."""
    r = request_at(history, prompt, params, sample_index)
    logits = mask_early_stop(apply_penalties(target_logits(history)[None].float(), [r]), [r])
    return sampling_probs(logits, [params])[0]


def spec_on(prompt: list[int], params: SamplingParams, sample_index: int, n: int, reference: list[int],
            k: int) -> tuple[list[int], int]:
    """Speculate with drafts that are the reference's tokens with some corrupted; returns the
    output and how many drafts were accepted (so the test knows both paths ran)."""
    g = torch.Generator().manual_seed(7)
    history, accepted = list(prompt), 0
    while len(history) - len(prompt) < n:
        done = len(history) - len(prompt)
        draft = reference[done: done + k]
        draft = [t if torch.rand(1, generator=g).item() < 0.7 else int(torch.randint(VOCAB, (1,), generator=g))
                 for t in draft]
        rows = torch.stack([pipeline_probs(history + draft[:i], prompt, params, sample_index)
                            for i in range(len(draft) + 1)])
        emitted = accept_seeded(draft, rows, seeded_uniforms(params.seed, sample_index, len(history), len(draft) + 1))
        accepted += len(emitted) - 1
        history += emitted
    return history[len(prompt): len(prompt) + n], accepted


@pytest.mark.parametrize("sample_index", [0, 3])
def test_seeded_verification_reproduces_spec_off_sampling(sample_index):
    params = SamplingParams(**PARAMS)
    prompt, n = [1, 2, 3, 1, 2], 40
    reference = spec_off(prompt, params, sample_index, n)
    output, accepted = spec_on(prompt, params, sample_index, n, reference + [0] * 8, k=4)
    assert output == reference
    assert 0 < accepted < n  # drafts were both accepted and rejected


def test_seeded_needs_matching_shapes():
    with pytest.raises(ValueError, match="seeded verify"):
        accept_seeded([1], torch.ones(2, VOCAB), torch.ones(3, dtype=torch.float64) / 2)


# -- unseeded: the rejection sampler keeps the target distribution -----------------------

# Chi-square critical values at significance 1e-3 by degrees of freedom (no scipy here).
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}
DRAWS = 200_000
V = 5


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """The statistic over p's support; a token outside the support fails outright."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, "a token the target gives probability 0 was emitted"
    expected = p[p > 0].double() * len(tokens)
    return float(((counts[p > 0] - expected) ** 2 / expected).sum())


def assert_distributed_as(tokens: torch.Tensor, p: torch.Tensor) -> None:
    df = int((p > 0).sum()) - 1
    if df == 0:
        assert (tokens == int(p.argmax())).all()
        return
    assert chi_square(tokens, p) < CHI2_CRITICAL[df]


def draw_drafts(q: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[DRAWS, K] drafts, position i from q[i]."""
    return torch.stack([torch.multinomial(q[i], DRAWS, replacement=True, generator=g) for i in range(len(q))], dim=1)


def run(q: torch.Tensor, p: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [K, V], p [K+1, V] shared by DRAWS sequences: (drafts, num_accepted, next_token)."""
    g = torch.Generator().manual_seed(seed)
    draft = draw_drafts(q, g)
    num_accepted, next_token = rejection_sample(draft, q.expand(DRAWS, *q.shape), p.expand(DRAWS, *p.shape), g)
    return draft, num_accepted, next_token


def first_emitted(draft: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    return torch.where(num_accepted > 0, draft[:, 0], next_token)


def rows(*values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum(dim=1, keepdim=True)


CASES = {
    "disagree": (rows([0.5, 0.2, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.3, 0.4]),
                 rows([0.1, 0.1, 0.2, 0.3, 0.3], [0.3, 0.3, 0.2, 0.1, 0.1], [0.2] * 5)),
    "disjoint": (rows([0, 0, 0, 0.5, 0.5], [0, 0, 0, 0.9, 0.1]),
                 rows([0.2, 0.5, 0.3, 0, 0], [0.6, 0.4, 0, 0, 0], [0.1, 0.2, 0.3, 0.4, 0])),
    "one_hot_draft": (rows([0, 1, 0, 0, 0], [0, 0, 0, 1, 0]),
                      rows([0.3, 0.3, 0.2, 0.1, 0.1], [0.1, 0.4, 0.1, 0.3, 0.1], [0.5, 0.5, 0, 0, 0])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_sampler_first_token_is_distributed_as_p(case):
    q, p = CASES[case]
    draft, num_accepted, next_token = run(q, p, seed=11)
    assert_distributed_as(first_emitted(draft, num_accepted, next_token), p[0])
    if case == "disjoint":
        assert (num_accepted == 0).all()


def test_rejection_sampler_with_q_equal_p_accepts_everything():
    p = rows([0.4, 0.3, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6], [0.2, 0.2, 0.2, 0.2, 0.2])
    draft, num_accepted, next_token = run(p[:2], p, seed=12)
    assert (num_accepted == 2).all()  # acceptance rate 1.0
    assert_distributed_as(draft[:, 0], p[0])
    assert_distributed_as(next_token, p[2])  # the bonus token comes from the last row


def test_rejection_sampler_second_token_given_the_first_accepted():
    # K = 1: when the draft is accepted the next token is the bonus, from p[1].
    q, p = rows([0.2, 0.2, 0.2, 0.2, 0.2]), rows([0.1, 0.2, 0.3, 0.2, 0.2], [0.5, 0.1, 0.1, 0.1, 0.2])
    _, num_accepted, next_token = run(q, p, seed=13)
    assert_distributed_as(next_token[num_accepted == 1], p[1])
    # Acceptance probability: sum_x min(q(x), p(x)).
    expected = float(torch.minimum(q[0], p[0]).sum())
    assert abs(float((num_accepted == 1).double().mean()) - expected) < 0.01


def test_accept_rejection_one_sequence():
    g = torch.Generator().manual_seed(0)
    p = rows([0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0])
    assert accept_rejection([1, 2], p[:2], p, g) == [1, 2, 3]
    assert accept_rejection([1, 4], p[:2], p, g) == [1, 2]
    assert accept_rejection([], p[:0], p[:1], g) == [1]
    with pytest.raises(ValueError, match="verify: 1 drafts need 2 target positions, got 3"):
        accept_rejection([1], p[:1], p, g)


def test_rejection_sample_checks_shapes():
    g = torch.Generator()
    with pytest.raises(ValueError, match="rejection sample"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, V), torch.ones(2, 3, V), g)

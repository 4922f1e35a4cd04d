"""Which of a sequence's K drafts it keeps, given the target's results at K+1 positions.

The target scores the last accepted token plus the K drafts in one pass; position i's
row is what the target says after history + draft[:i]:

    input:     t0     d0     d1    ...  d(K-1)
    position:  0      1      2          K
    row i:     next token after history + draft[:i]  (row K: the bonus position)

    emitted:   draft[:a] + [one token the target chose]        1 <= len <= K+1

Every rule here emits the drafts it accepts, a = 0..K of them, then exactly one token
of the target's own: its correction at the first rejected position, or the bonus token
(row K) when all K are accepted. Cutting at stops and `max_tokens` is the caller's.

In the engine every rule is one call: the sampler runs at each position's
`SequenceAt` (greedy: argmax; seeded: the position's own uniform; unseeded: a fresh
uniform), then `accept_matching`. For the proposers here, which draft deterministically
(q is one-hot), accepting a draft exactly when the sampled token equals it IS the
rejection sampler: it accepts x with probability p(x) = min(1, p(x)/q(x)), and on a
rejection the sampled token is distributed as p without x, renormalised, which is
normalize(max(0, p - q)). `rejection_sample` is the general rule, for a proposer that
samples its drafts.

Three rules:
- greedy: accept while the draft equals the target's argmax.
- seeded: the token the target would sample at position i is the inverse CDF of its
  probabilities at the uniform spec-off sampling uses for that position (sampler.py's
  splitmix64 of (seed, sample index, number of tokens)); accept a draft exactly when it
  equals that token. The output is then spec-off sampling's, token for token.
- unseeded: the standard rejection sampler (Leviathan et al., Chen et al.): accept
  draft x with probability min(1, p(x) / q(x)); on rejection sample from
  normalize(max(0, p - q)); bonus from p. The emitted tokens are distributed as p's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import sample_inverse_cdf, seeded_uniform
from pdserve.engine.sampling_params import SamplingParams


class SequenceAt:
    """`request` as it would stand after its first `num_drafts` drafts were accepted: what
    the sampler reads of a sequence (history for penalties, output count for min_tokens,
    token count for the seeded uniform). Position i of a verification samples from
    `SequenceAt(request, i)` exactly what spec-off sampling would sample from `request`
    once it held those i drafts."""

    __slots__ = ("request", "num_drafts")

    def __init__(self, request: Request, num_drafts: int) -> None:
        self.request = request
        self.num_drafts = num_drafts

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.request.eos_token_ids

    @property
    def sample_index(self) -> int:
        return self.request.sample_index

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.request.spec_token_ids[: self.num_drafts]

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + self.num_drafts

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.num_drafts


def positions(request: Request) -> list[SequenceAt]:
    """The K+1 sampling positions of a verification of `request.spec_token_ids`."""
    return [SequenceAt(request, i) for i in range(len(request.spec_token_ids) + 1)]


def accept_matching(draft: Sequence[int], target_tokens: Sequence[int]) -> list[int]:
    """The drafts while each equals the target's token at its position, then the target's
    token at the first mismatch (or at position K, the bonus, after all K matched).
    len(target_tokens) == len(draft) + 1; the result has 1..K+1 tokens."""
    _check_positions(len(draft), len(target_tokens))
    accepted = []
    for drafted, target in zip(draft, target_tokens):
        if drafted != target:
            break
        accepted.append(int(drafted))
    return accepted + [int(target_tokens[len(accepted)])]


def accept_greedy(draft: Sequence[int], target_argmax: Sequence[int] | torch.Tensor) -> list[int]:
    """Greedy verification: `target_argmax[i]` is the target's argmax at position i (K+1)."""
    return accept_matching(draft, _as_list(target_argmax))


def accept_seeded(draft: Sequence[int], target_probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """Seeded verification. `target_probs`: [K+1, V] rows after the full sampling pipeline
    (unnormalised rows are fine); `uniforms`: [K+1], position i's spec-off uniform
    (`seeded_uniforms`). Emits what spec-off sampling would, token for token."""
    if target_probs.dim() != 2 or uniforms.shape != (target_probs.shape[0],):
        raise ValueError(f"seeded verify: need probs [K+1, V] and uniforms [K+1], got "
                         f"{tuple(target_probs.shape)} and {tuple(uniforms.shape)}")
    targets = sample_inverse_cdf(target_probs, uniforms.to(torch.float64)).tolist()
    return accept_matching(draft, targets)


def seeded_uniforms(seed: int, sample_index: int, num_tokens: int, count: int) -> torch.Tensor:
    """[count] float64 uniforms of positions 0..count-1 of a verification whose sequence
    holds `num_tokens` tokens before it (position i samples token number num_tokens + i)."""
    return torch.tensor([seeded_uniform(seed, sample_index, num_tokens + i) for i in range(count)],
                        dtype=torch.float64)


def rejection_sample(draft: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection sampler over a batch of B sequences with K drafts each.

    draft [B, K] token ids; draft_probs q [B, K, V] (the proposer's distribution each
    draft came from: one-hot for a deterministic proposer); target_probs p [B, K+1, V]
    (rows sum to 1). Returns (num_accepted [B] in 0..K, next_token [B]): sequence b emits
    draft[b, :num_accepted[b]] then next_token[b]. All on p's device, draws from
    `generator` (on that device) only."""
    batch, k = draft.shape
    if draft_probs.shape[:2] != (batch, k) or target_probs.shape[:2] != (batch, k + 1) \
            or draft_probs.shape[2] != target_probs.shape[2]:
        raise ValueError(f"rejection sample: need draft [B, K], q [B, K, V], p [B, K+1, V], got "
                         f"{tuple(draft.shape)}, {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}")
    p, q = target_probs.double(), draft_probs.double()
    index = draft.long()[:, :, None]
    px, qx = p[:, :k].gather(2, index).squeeze(2), q.gather(2, index).squeeze(2)
    u = torch.rand((batch, k), dtype=torch.float64, device=p.device, generator=generator)
    # u < min(1, p/q), written without the division (q(x) = 0 only if x was never drafted).
    accepted = u * qx < px
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    # Row num_accepted: the residual max(0, p - q) after a rejection, p itself at the bonus.
    residual = torch.cat([(p[:, :k] - q).clamp_(min=0), p[:, k:]], dim=1)
    rows = torch.arange(batch, device=p.device)
    chosen = residual[rows, num_accepted]
    # p == q at a rejected position leaves no residual mass; rejection is then a rounding
    # artefact, and p is the exact distribution to fall back on.
    empty = chosen.sum(dim=1) <= 0
    chosen = torch.where(empty[:, None], p[rows, num_accepted], chosen)
    v = torch.rand(batch, dtype=torch.float64, device=p.device, generator=generator)
    return num_accepted, sample_inverse_cdf(chosen, v)


def accept_rejection(draft: Sequence[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator) -> list[int]:
    """Unseeded verification of one sequence: `rejection_sample` with B = 1, as tokens.
    draft_probs [K, V], target_probs [K+1, V]; the result has 1..K+1 tokens."""
    _check_positions(len(draft), target_probs.shape[0])
    drafted = torch.tensor([list(draft)], dtype=torch.long, device=target_probs.device).reshape(1, len(draft))
    num_accepted, next_token = rejection_sample(drafted, draft_probs[None], target_probs[None], generator)
    a = int(num_accepted[0])
    return [int(t) for t in draft[:a]] + [int(next_token[0])]


def _check_positions(num_drafts: int, num_rows: int) -> None:
    if num_rows != num_drafts + 1:
        raise ValueError(f"verify: {num_drafts} drafts need {num_drafts + 1} target positions, got {num_rows}")


def _as_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)

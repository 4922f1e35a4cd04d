"""Turn next-token logits into tokens, vectorised over the batch, on the logits' device.

Order of processing (each step only touches the rows that asked for it):

    raw logits
        | (engine/core.py, before the sampler) structured outputs: tokens the
        | grammar does not allow next -> -inf
    logits --log_softmax--> logprobs reported to the user (and cumulative_logprob):
        |                   a constrained row's are its constrained distribution's
        logit_bias (OpenAI's: added to the logits; not in the reported logprobs)
        |
        penalties (repetition: HF semantics over prompt+output; presence/frequency:
        OpenAI semantics over output) -> min_tokens (EOS/stop ids masked)
        |-- greedy rows: argmax
        `-- sampled rows: / temperature -> top-k -> top-p -> min-p -> softmax ->
            inverse CDF at u   (the first token whose cumulative probability
                                exceeds u ~ U(0, 1): an exact sample)

Only rows that use top-k / top-p are sorted (top-k alone needs no sort at all), so a
row with top_p = 1 and top_k off is never touched: its candidates do not depend on
its batch companions.

Each row needs one uniform u, made on the host: for a seeded row a hash (splitmix64)
of (seed, sample index, position) alone, so its tokens do not depend on its batch
companions, on preemption, on scheduling or on the device; unseeded rows draw theirs
from the engine's own generator. No generator object ever touches the device.

Everything up to `SampledTensors` stays on the logits' device; `to_host` is the one
place results cross to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

_MASK = float("-inf")
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each chosen token
    top_logprobs: list[dict[int, float] | None]  # per row, when the request asked


@dataclass(frozen=True)
class SampledTensors:
    """A step's samples, still on the device: [B] tokens and logprobs, [B, K] top-k."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None

    def to_host(self, requests: Sequence[Request]) -> SampleResult:
        tokens, chosen = self.token_ids.tolist(), self.logprobs.tolist()
        if self.top_ids is None or self.top_values is None:
            top = [None if r.sampling_params.logprobs is None else {} for r in requests]
            return SampleResult(tokens, chosen, top)
        ids, values = self.top_ids.tolist(), self.top_values.tolist()
        top = []
        for i, r in enumerate(requests):
            k = r.sampling_params.logprobs
            top.append(None if k is None else dict(zip(ids[i][:k], values[i][:k])))
        return SampleResult(tokens, chosen, top)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Unseeded rows draw from this engine-owned generator (never torch's global one).
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SampleResult:
        return self.sample(logits, requests).to_host(requests)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SampledTensors:
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_logit_bias(logits, requests)
        logits = apply_penalties(logits, requests)
        logits = mask_early_stop(logits, requests)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if len(rows) == len(requests):
            tokens = self._sample(logits, requests)
        elif rows:
            index = torch.tensor(rows, device=logits.device)
            picked = self._sample(logits.index_select(0, index), [requests[i] for i in rows])
            tokens = tokens.index_copy(0, index, picked)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return SampledTensors(tokens, chosen, *_top_logprobs(logprobs, requests))

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        probs = sampling_probs(logits, [r.sampling_params for r in requests])
        u = torch.tensor(self._uniforms(requests), dtype=torch.float64, device=logits.device)
        return sample_inverse_cdf(probs, u)

    def _uniforms(self, requests: Sequence[Request]) -> list[float]:
        """One uniform in (0, 1) per row: a hash of its key when seeded, else drawn."""
        num_unseeded = sum(1 for r in requests if r.sampling_params.seed is None)
        fresh = torch.rand(num_unseeded, dtype=torch.float64, generator=self.generator).tolist()
        return [fresh.pop() if r.sampling_params.seed is None else _uniform(_key(r.sampling_params.seed, r))
                for r in requests]


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled row draws from, given its logits after penalties and
    min_tokens: / temperature -> top-k -> top-p -> min-p -> softmax."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps[:, None]
    logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    logits = apply_min_p(logits, [p.min_p for p in params])
    return torch.softmax(logits, dim=-1)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row b's token: the first whose cumulative probability exceeds u[b] (an exact sample
    for u uniform; the sum runs in float64, so no token's mass is lost to rounding)."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _key(seed: int, request: Request) -> int:
    return position_key(seed, request.sample_index + request.sampling_params.sample_index, request.num_tokens)


def position_key(seed: int, sample_index: int, num_tokens: int) -> int:
    """The hash key of the token a seeded sequence samples when it holds `num_tokens`
    tokens (speculative verification draws the same uniform at each verified position)."""
    return (seed * 1_000_003 + sample_index * 7_919 + num_tokens) % (1 << 64)


def seeded_uniform(seed: int, sample_index: int, num_tokens: int) -> float:
    """The uniform a seeded sequence's sample uses when it holds `num_tokens` tokens."""
    return _uniform(position_key(seed, sample_index, num_tokens))


def _uniform(key: int) -> float:
    """splitmix64 of the key -> 53 random bits -> a float in (0, 1)."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 0.5) * 2.0**-53


def _generated(request: Request) -> list[int]:
    """What presence and frequency penalties count: the output, and the prompt's last
    `resumed_tokens` (a migrated sequence's own output, sent before the cut)."""
    return request.token_ids[request.num_prompt_tokens - request.sampling_params.resumed_tokens:]


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Add each row's logit_bias (sorted (token, bias) pairs, tokens < vocab: checked at
    admission) to its logits; rows without one are untouched."""
    pairs = [(i, token, bias) for i, r in enumerate(requests) for token, bias in r.sampling_params.logit_bias]
    if not pairs:
        return logits
    rows, cols, biases = zip(*pairs)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Repetition penalty (HF: over prompt and output, divide positive logits, multiply
    negative ones) and presence / frequency penalties (OpenAI: over output), for the
    rows that ask, in one pass over a [rows, vocab] count of their tokens."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return logits
    out = logits.clone()
    params = [requests[i].sampling_params for i in rows]
    device, vocab = logits.device, logits.shape[1]

    def penalise(x: torch.Tensor) -> torch.Tensor:
        seen = _token_counts([requests[i].token_ids for i in rows], vocab, device) > 0
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        counts = _token_counts([_generated(requests[i]) for i in rows], vocab, device)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        return x - freq * counts - presence * (counts > 0)

    _update_rows(out, rows, penalise)
    return out


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    flat = [row * vocab + t for row, tokens in enumerate(token_lists) for t in tokens if 0 <= t < vocab]
    counts = torch.zeros(len(token_lists) * vocab, device=device)
    if flat:
        index = torch.tensor(flat, dtype=torch.long, device=device)
        counts.scatter_add_(0, index, torch.ones(len(flat), device=device))
    return counts.view(len(token_lists), vocab)


def mask_early_stop(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Forbid EOS and stop tokens until a request has its min_tokens (unless nothing
    else is allowed: a structured-outputs mask may leave only a stop token)."""
    vocab = logits.shape[1]
    pairs = [
        (i, t)
        for i, r in enumerate(requests)
        if r.num_output_tokens < r.sampling_params.min_tokens
        for t in (*r.eos_token_ids, *r.sampling_params.stop_token_ids)
        if t < vocab
    ]
    if not pairs:
        return logits
    rows, cols = torch.tensor(pairs, dtype=torch.long, device=logits.device).T
    masked = logits.index_put((rows, cols), torch.tensor(_MASK, device=logits.device))
    # A row left with no token at all (a grammar that allows only a stop token now):
    # the grammar wins, min_tokens yields.
    dead = torch.isinf(masked).all(dim=-1, keepdim=True)
    return torch.where(dead, logits, masked)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Keep each row's k most likely tokens, then its smallest set with mass >= p.

    Rows with neither are returned bit for bit; rows with top-k alone are cut at their
    k-th largest logit (ties at it kept), without sorting; only top-p rows are sorted."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    nucleus = [i for i, p in enumerate(top_p) if p < 1.0]
    k_only = [i for i, k in enumerate(ks) if k and top_p[i] >= 1.0]
    if not nucleus and not k_only:
        return logits
    out = logits.clone()
    if k_only:
        _update_rows(out, k_only, lambda x: _top_k_only(x, [ks[i] for i in k_only]))
    if nucleus:
        _update_rows(out, nucleus, lambda x: _top_k_top_p_sorted(x, [ks[i] for i in nucleus], [top_p[i] for i in nucleus]))
    return out


def _update_rows(logits: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """logits[rows] = fn(logits[rows]), in place; the whole tensor when every row is meant."""
    if len(rows) == logits.shape[0]:
        logits.copy_(fn(logits))
        return
    index = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, index, fn(logits.index_select(0, index)))


def _top_k_only(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    k = torch.tensor(ks, device=logits.device)
    kth = logits.topk(max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, _MASK)


def _top_k_top_p_sorted(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Sorted ascending, as vLLM: the mass is summed from the unlikely end, where float32
    sums of tiny probabilities stay accurate, and the most likely token always stays."""
    vocab = logits.shape[1]
    device = logits.device
    ordered, order = logits.sort(dim=-1)
    if any(ks):
        keep_from = torch.tensor([vocab - k if k else 0 for k in ks], device=device)
        ordered = ordered.masked_fill(torch.arange(vocab, device=device)[None, :] < keep_from[:, None], _MASK)
    mass_up_to = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    remove = mass_up_to <= torch.tensor([1.0 - p for p in ps], device=device)[:, None]
    remove[:, -1] = False
    return torch.empty_like(logits).scatter_(1, order, ordered.masked_fill(remove, _MASK))


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely one's."""
    rows = [i for i, p in enumerate(min_p) if p > 0.0]
    if not rows:
        return logits
    out = logits.clone()

    def cut(x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(x, dim=-1)
        threshold = torch.tensor([min_p[i] for i in rows], device=x.device)[:, None] * probs.amax(dim=-1, keepdim=True)
        return x.masked_fill(probs < threshold, _MASK)

    _update_rows(out, rows, cut)
    return out


def _top_logprobs(logprobs: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    wanted = max((r.sampling_params.logprobs or 0 for r in requests), default=0)
    if not wanted:
        return None, None
    values, ids = logprobs.topk(min(wanted, logprobs.shape[1]), dim=-1)
    return ids, values

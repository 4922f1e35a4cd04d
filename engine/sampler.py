"""Turn next-token logits into tokens, vectorised over the batch.

Order of processing (each step only touches the rows that asked for it):

    raw logits --log_softmax--> logprobs reported to the user (and cumulative_logprob)
        |
        penalties (repetition: HF semantics over prompt+output; presence/frequency:
        OpenAI semantics over output) -> min_tokens (EOS/stop ids masked)
        |-- greedy rows: argmax
        `-- sampled rows: / temperature -> top-k -> top-p -> min-p -> softmax ->
            argmax(probs / Exp(1) noise)   (the exponential race: an exact sample)

Seeded rows draw their noise from a generator derived from (seed, sample index,
position) alone, so a request's tokens do not depend on its batch companions, on
preemption, or on scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request

_MASK = float("-inf")


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each chosen token
    top_logprobs: list[dict[int, float] | None]  # per row, when the request asked


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Unseeded requests share this engine-owned generator (never torch's global one).
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits, requests)
        logits = mask_early_stop(logits, requests)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rows:
            tokens[rows] = self._sample(logits[rows], [requests[i] for i in rows])
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return SampleResult(tokens.tolist(), chosen.tolist(), _top_logprobs(logprobs, requests))

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.sampling_params.temperature for r in requests])
        logits = logits / temps[:, None]
        logits = apply_top_k_top_p(
            logits,
            [r.sampling_params.top_k for r in requests],
            [r.sampling_params.top_p for r in requests],
        )
        logits = apply_min_p(logits, [r.sampling_params.min_p for r in requests])
        probs = torch.softmax(logits, dim=-1)
        noise = torch.stack([self._noise(r, probs.shape[1]) for r in requests])
        return (probs / noise).argmax(dim=-1)

    def _noise(self, request: Request, vocab: int) -> torch.Tensor:
        seed = request.sampling_params.seed
        gen = self.generator if seed is None else torch.Generator().manual_seed(_mix(seed, request))
        return torch.empty(vocab).exponential_(generator=gen)


def _mix(seed: int, request: Request) -> int:
    return (seed * 1_000_003 + request.sample_index * 7_919 + request.num_tokens) % (1 << 63)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        params, req = requests[i].sampling_params, requests[i]
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def mask_early_stop(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid EOS and stop tokens until a request has its min_tokens."""
    rows = [i for i, r in enumerate(requests) if r.num_output_tokens < r.sampling_params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        req = requests[i]
        banned = [t for t in (*req.eos_token_ids, *req.sampling_params.stop_token_ids) if t < logits.shape[1]]
        logits[i, banned] = _MASK
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's k most likely tokens, then its smallest set with mass >= p."""
    if all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    ks = torch.tensor([k if k > 0 else vocab for k in top_k])[:, None]
    remove = ranks >= ks
    sorted_logits = sorted_logits.masked_fill(remove, _MASK)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    remove |= before >= torch.tensor(top_p)[:, None]
    remove[:, 0] = False  # always keep the most likely token
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, _MASK))


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely one's."""
    if all(p == 0.0 for p in min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = torch.tensor(min_p)[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _MASK)


def _top_logprobs(logprobs: torch.Tensor, requests: list[Request]) -> list[dict[int, float] | None]:
    wanted = [r.sampling_params.logprobs or 0 for r in requests]
    if not any(wanted):
        return [None if r.sampling_params.logprobs is None else {} for r in requests]
    values, ids = logprobs.topk(max(wanted), dim=-1)
    out: list[dict[int, float] | None] = []
    for i, r in enumerate(requests):
        k = r.sampling_params.logprobs
        out.append(None if k is None else dict(zip(ids[i, :k].tolist(), values[i, :k].tolist())))
    return out

"""Turn next-token logits into tokens, per request (greedy or temperature sampling)."""

from __future__ import annotations

import torch

from engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row of `logits` [S, vocab] for the matching request."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (req, token) in enumerate(zip(requests, greedy)):
        params = req.sampling_params
        if params.greedy:
            out.append(token)
            continue
        probs = torch.softmax(logits[row] / params.temperature, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=_generator(req)).item()))
    return out


def _generator(req: Request) -> torch.Generator | None:
    seed = req.sampling_params.seed
    if seed is None:
        return None
    # Derived from the seed and the position, so a request's tokens do not depend on
    # what else is in the batch or on how often it was preempted.
    return torch.Generator().manual_seed(seed * 1_000_003 + req.num_tokens)

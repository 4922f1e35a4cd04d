"""Speculative decoding inside the engine: who drafts, how many, and what was kept.

    step():  propose  drafts on every running sequence that is decoding
                      (request.spec_token_ids, K <= its adaptive draft length)
             schedule K+1 query tokens, K lookahead slots (scheduler.py)
             forward  one pass scores its last token and every draft (K+1 rows)
             verify   the sampler runs at each of the K+1 positions as it would
                      without speculation (verify.positions); accept_matching keeps
                      the drafts up to the first one it would not have sampled, then
                      the token it did sample
             append   one token at a time, each through the usual stop checks: the
                      first stop, EOS, stop string or max_tokens ends the run there
             record   counts below; the draft length follows the acceptance (adaptive.py)

Who does not speculate: beam search (counted in `num_unspeculated_requests`), a sequence
still prefilling, and every sequence while the running batch has reached
`disable_by_batch_size` (a compute-bound batch gains nothing from drafts) or while
drafting does not pay on this engine's own timings (adaptive.Payoff).

Drafts are capped so that no draft position lies past `max_tokens` (the bonus token
is the last one the request may have), past `max_model_len`, or after a drafted stop
token or EOS: verification never scores a token that could not be emitted (a stop
string, known only from the text, can still cut an accepted run short). A constrained
sequence's drafts are also cut, by the engine (core.py `_constrain_drafts`), at the
first one its grammar refuses; its verification's rows are masked by the grammar.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.spec.draft_state import DraftLayout, DraftState
from pdserve.engine.model.llama import FeatureCapture
from pdserve.engine.request import Request
from pdserve.engine.spec.adaptive import DraftLength, Payoff
from pdserve.engine.spec.eagle import EagleProposer
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.ngram import propose_ngram

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecStats:
    """Counters since start (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # verifications that scored at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # drafts emitted (a run cut at a stop counts what was emitted)
    # [i]: verifications whose draft i was accepted and emitted (non-increasing in i)
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_unspeculated_requests: int = 0  # beam-search requests, decoded without speculation


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow requests[i]'s tokens (fewer, or none, is fine)."""
        ...

    def release(self, request_id: str) -> None:
        """The sequence is gone: drop whatever the proposer keeps for it."""
        ...

    def check_integrity(self, live: Collection[str]) -> None:
        """Raise if it keeps anything for a sequence not in `live`."""
        ...


class NgramProposer:
    """Prompt lookup: the drafts follow the longest earlier occurrence of the suffix."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        return [propose_ngram(r.token_ids, k, self.min_n, self.max_n) for r, k in zip(requests, ks)]

    def release(self, request_id: str) -> None:
        pass

    def check_integrity(self, live: Collection[str]) -> None:
        pass


def _through_first_stop(request: Request, drafts: list[int]) -> list[int]:
    """Drafts up to and including the first stop token or EOS: if it is accepted the run
    ends there, so a draft after it could never be emitted."""
    params = request.sampling_params
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
    for i, token in enumerate(drafts):
        if token in stops:
            return drafts[: i + 1]
    return drafts


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._lengths: dict[str, DraftLength] = {}
        self._num_drafts = self._num_draft_tokens = self._num_accepted = self._num_unspeculated = 0
        self._per_pos = [0] * config.num_speculative_tokens
        self.payoff = Payoff()
        self._step: tuple[bool, int, int] | None = None  # this decoding step's (drafted, verifications, accepted)

    def propose(self, running: Sequence[Request], may_draft: Callable[[Request], bool]) -> None:
        """Set this step's drafts: on the running sequences that `may_draft`, none on the
        others (a sequence's draft length is forgotten in `release`, when it ends)."""
        for request in running:
            request.spec_token_ids.clear()
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        candidates = [r for r in running if may_draft(r)]
        if not candidates:
            return
        if self.config.measure_payoff and not self.payoff.should_draft():
            self._step = (False, 0, 0)  # timed as a plain decoding step
            return
        chosen, ks = [], []
        for request in candidates:
            k = min(self._length(request).next_k(), self._room(request))
            if k > 0:
                chosen.append(request)
                ks.append(k)
        if not chosen:
            return
        self._step = (True, 0, 0)
        for request, k, drafts in zip(chosen, ks, self.proposer.propose(chosen, ks)):
            request.spec_token_ids[:] = _through_first_stop(request, [int(t) for t in drafts[:k]])

    def _length(self, request: Request) -> DraftLength:
        length = self._lengths.get(request.request_id)
        if length is None:
            length = self._lengths[request.request_id] = DraftLength(self.config.num_speculative_tokens)
        return length

    def _room(self, request: Request) -> int:
        """Drafts that could still be emitted: the bonus token takes the last place."""
        by_length = request.sampling_params.max_tokens - request.num_output_tokens - 1
        return max(0, min(by_length, self.max_model_len - request.num_tokens))

    def record(self, request_id: str, drafted: int, accepted: int, emitted: int) -> None:
        """A verification of `drafted` drafts accepted `accepted`, of which `emitted` were
        emitted (fewer when a stop or max_tokens cut the run)."""
        if drafted <= 0:
            return
        if self._step is not None:
            drafted_step, verifications, total = self._step
            self._step = (drafted_step, verifications + 1, total + accepted)
        self._num_drafts += 1
        self._num_draft_tokens += drafted
        self._num_accepted += emitted
        for i in range(emitted):
            self._per_pos[i] += 1
        length = self._lengths.get(request_id)  # none once the sequence ended
        if length is not None:
            length.update(drafted, accepted)

    def step_done(self, seconds: float, decoding_only: bool) -> None:
        """The engine step that began with this step's proposals took `seconds`; only a
        step of decoding sequences alone (no prompt in the batch) is measured."""
        if self._step is not None and decoding_only:
            self.payoff.observe(self._step[0], seconds, *self._step[1:])
        self._step = None

    def capture(self) -> FeatureCapture | None:
        """What the target's forward pass must keep for the proposer (EAGLE's hidden
        states), or None."""
        return self.proposer.capture() if isinstance(self.proposer, EagleProposer) else None

    def observe(self, request_id: str, start: int, features: torch.Tensor) -> None:
        """The target's features of positions start .. of a sequence that may speculate."""
        if isinstance(self.proposer, EagleProposer):
            self.proposer.observe(request_id, start, features)

    def fork(self, parent_id: str, child_id: str) -> None:
        """A sample forked off `parent_id`'s prompt: it drafts from the same history."""
        if isinstance(self.proposer, EagleProposer):
            self.proposer.fork(parent_id, child_id)

    def prime(self, requests: Sequence[Request]) -> None:
        """Prompts whose features just arrived: the proposer may take them in now."""
        if isinstance(self.proposer, EagleProposer):
            self.proposer.prime(requests)

    @property
    def draft_layout(self) -> DraftLayout | None:
        """What the proposer's per-prompt state for a decode worker is (None: it keeps none)."""
        return self.proposer.layout if isinstance(self.proposer, EagleProposer) else None

    def export(self, request: Request) -> DraftState | None:
        """Prefill side: the proposer's state at the end of `request`'s prompt, to ship."""
        return self.proposer.export(request) if isinstance(self.proposer, EagleProposer) else None

    def adopt(self, request: Request, state: DraftState) -> None:
        """Decode side: the state a prefill worker shipped for `request`'s prompt (a
        state that does not fit is dropped, logged: drafting then starts afresh, the
        tokens do not change)."""
        if not isinstance(self.proposer, EagleProposer):
            return
        try:
            self.proposer.adopt(request, state)
        except ValueError as exc:
            log.warning("speculative state shipped for %r dropped: %s", request.request_id, exc)

    def skip(self) -> None:
        """A request that will decode without speculation (beam search)."""
        self._num_unspeculated += 1

    def release(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)
        self.proposer.release(request_id)

    def check_integrity(self, live: Collection[str]) -> None:
        """Nothing is kept for a sequence that has ended (`live`: the engine's sequences)."""
        stale = set(self._lengths) - set(live)
        if stale:
            raise RuntimeError(f"speculator: draft lengths kept for ended sequences {sorted(stale)[:3]}")
        self.proposer.check_integrity(live)

    def stats(self) -> SpecStats:
        return SpecStats(
            self._num_drafts, self._num_draft_tokens, self._num_accepted, tuple(self._per_pos),
            self._num_unspeculated,
        )

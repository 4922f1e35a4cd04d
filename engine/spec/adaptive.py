"""How much to draft: per sequence, a draft length that follows its acceptance
(`DraftLength`); per engine, whether drafting pays at all on what it measured (`Payoff`).

    verified k drafts, a accepted    next k
    a == k (all)                     k + 1            (up to num_speculative_tokens)
    0 < a < k                        a + 1            (one more than it got right)
    a == 0                           1, and after 2 misses in a row a pause of
                                     2, 4, 8 ... 64 steps without drafts, then 1 again

A sequence whose drafts keep failing stops paying for their verification (a pause costs
at most one probe per pause), and one whose drafts keep landing grows back to the
maximum within a few steps. The rule is EAGLE-2/3's and Hugging Face's assisted
generation's idea (draft length from recent acceptance) in its plainest form.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 64
MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 8, 128


@dataclass
class DraftLength:
    max_k: int
    k: int = 0
    misses: int = 0  # verifications in a row that accepted nothing
    paused: int = 0  # steps left without drafts

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    def next_k(self) -> int:
        """The draft length for this step (a paused sequence counts its pause down)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        """The verification of `drafted` drafts accepted `accepted` of them."""
        if drafted <= 0:
            return
        if accepted >= drafted:
            self.k, self.misses = min(self.max_k, drafted + 1), 0
        elif accepted > 0:
            self.k, self.misses = min(self.max_k, accepted + 1), 0
        else:
            self.k, self.misses = 1, self.misses + 1
            if self.misses >= 2:
                self.paused = min(MAX_PAUSE, 2 ** (self.misses - 1))


class Payoff:
    """Whether speculating pays on this engine right now, from what it measured.

    A step that speculates spends `propose` seconds drafting out of `step` seconds, and
    each verification yields 1 + accepted tokens where a plain step yields 1. Taking
    the step without drafting to cost `step - propose` (the extra query tokens of a
    verification ride on a memory-bound pass), drafting pays while

        (1 + accepted per verification) * (1 - propose / step)  >=  1

    on running averages. When it does not (a draft model whose guesses miss, on a
    machine where its passes are not cheap beside the target's), steps go without
    drafts, and one step in `probe_every` drafts again to refresh the figures (the
    interval doubles, up to MAX_PROBE_INTERVAL, while it keeps not paying). Only speed
    depends on this: what is emitted is the same either way.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.tokens_per_verification = 0.0  # 1 + accepted, averaged (0: not measured yet)
        self.propose_share = 0.0  # propose / step, averaged
        self.probe_every = MIN_PROBE_INTERVAL
        self._skipped = 0

    @property
    def pays(self) -> bool:
        if not self.tokens_per_verification:
            return True
        return self.tokens_per_verification * (1.0 - self.propose_share) >= 1.0

    def should_draft(self) -> bool:
        """Draft this step? (Counts the steps skipped since the last probe.)"""
        if self.pays:
            self.probe_every = MIN_PROBE_INTERVAL
            self._skipped = 0
            return True
        self._skipped += 1
        if self._skipped < self.probe_every:
            return False
        self._skipped = 0
        self.probe_every = min(MAX_PROBE_INTERVAL, 2 * self.probe_every)
        return True

    def observe(self, propose_seconds: float, step_seconds: float, verifications: int, accepted: int) -> None:
        """A step that drafted: its timings and what its verifications accepted."""
        if verifications <= 0 or step_seconds <= 0:
            return
        a = self.smoothing
        tokens = 1.0 + accepted / verifications
        share = min(1.0, propose_seconds / step_seconds)
        if not self.tokens_per_verification:
            self.tokens_per_verification, self.propose_share = tokens, share
            return
        self.tokens_per_verification += a * (tokens - self.tokens_per_verification)
        self.propose_share += a * (share - self.propose_share)

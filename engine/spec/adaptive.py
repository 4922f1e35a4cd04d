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
MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 8, 1024
PLAIN_PROBE_INTERVAL = 16


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
    """Whether speculating pays on this engine right now, from its own step timings.

    A decoding step that drafts takes `spec` seconds and yields, per sequence,
    1 + accepted tokens per verification; one that does not takes `plain` seconds and
    yields 1. Drafting pays while

        (1 + accepted per verification) * plain  >=  spec

    on running averages. Steps mostly run the mode that pays; one step in
    `probe_every` runs the other, so both figures stay current: every PLAIN_PROBE_INTERVAL
    steps a plain one while drafting pays, and while it does not, a drafting one every
    8, 16 ... MAX_PROBE_INTERVAL steps (doubling while it keeps not paying). Until both are
    measured, it drafts. Only speed depends on this: what is emitted is the same.

    The ceiling is high on purpose: a draft model's probe first catches up on every
    token its sequences gained since its last pass, so probing every n steps costs about
    a draft prefill of the whole output, whatever n, until n outlasts the sequences
    (measured: a ceiling of 128 left a losing draft model 3-8 % behind spec-off).
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.tokens = 0.0  # 1 + accepted per verification, averaged (0: not measured yet)
        self.spec = 0.0  # seconds of a drafting step, averaged
        self.plain = 0.0  # seconds of a decoding step without drafts, averaged
        self.probe_every = MIN_PROBE_INTERVAL
        self._since_probe = 0

    @property
    def pays(self) -> bool:
        if not (self.tokens and self.spec and self.plain):
            return True
        return self.tokens * self.plain >= self.spec

    def should_draft(self) -> bool:
        """Draft this step? The paying mode, but for one probe step per interval."""
        pays = self.pays
        self._since_probe += 1
        interval = PLAIN_PROBE_INTERVAL if pays else self.probe_every
        if self._since_probe < interval:
            return pays
        self._since_probe = 0
        if not pays:
            self.probe_every = min(MAX_PROBE_INTERVAL, 2 * self.probe_every)
        else:
            self.probe_every = MIN_PROBE_INTERVAL
        return not pays

    def observe(self, drafted: bool, step_seconds: float, verifications: int, accepted: int) -> None:
        """A decoding step: whether it drafted, its time, what its verifications accepted."""
        if step_seconds <= 0:
            return
        if not drafted:
            self.plain = self._average(self.plain, step_seconds)
        elif verifications > 0:
            self.spec = self._average(self.spec, step_seconds)
            self.tokens = self._average(self.tokens, 1.0 + accepted / verifications)

    def _average(self, mean: float, value: float) -> float:
        return value if not mean else mean + self.smoothing * (value - mean)

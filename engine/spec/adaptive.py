"""How many drafts a sequence proposes next: its draft length follows its acceptance.

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

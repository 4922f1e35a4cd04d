"""The n-gram (prompt lookup) proposer: drafts copied from earlier in the sequence.

    history:  a b c d x y a b c d e f ... a b c d      (prompt + output so far)
              `-----'                     `-----'
              earliest earlier occurrence  suffix of n tokens (n from max down to min)
                      `--> draft = the up-to-k tokens after that occurrence: x y ...

vLLM's semantics (vllm/v1/spec_decode/ngram_proposer.py): the longest suffix between
`min_n` and `max_n` tokens long that occurs earlier in the history wins, and of its
occurrences the EARLIEST one is copied (vLLM's KMP scan over the reversed history
updates its match on `>=`, which keeps the last hit in reversed order: the first in
the history). An earlier occurrence may overlap the suffix, but never is the suffix
itself: it ends at least one token before the history does, so there is always at
least one token after it. The draft stops at the end of the history (fewer than k
tokens then). Same answers as vLLM's, by a plainer route: a vectorised window compare
per n, O(len(history) * n) each, which is small beside a forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(history: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for `history`, or [] when no suffix of `min_n`..`max_n`
    tokens occurs earlier. Requires 1 <= min_n <= max_n and k >= 0."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"ngram bounds: need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
    if k < 0:
        raise ValueError(f"ngram k: must be >= 0, got {k}")
    tokens = np.asarray(history, dtype=np.int64)
    total = len(tokens)
    if k == 0:
        return []
    # The suffix itself is not a candidate: occurrences end before the last token.
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        start = _earliest_occurrence(tokens[: total - 1], tokens[total - n :])
        if start is not None:
            follow = start + n
            return tokens[follow : follow + k].tolist()
    return []


def _earliest_occurrence(haystack: np.ndarray, pattern: np.ndarray) -> int | None:
    """The first index i with haystack[i:i+len(pattern)] == pattern, or None."""
    n = len(pattern)
    if len(haystack) < n:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(haystack, n)
    hits = np.flatnonzero((windows == pattern).all(axis=1))
    return int(hits[0]) if len(hits) else None

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
tokens then). Same answers as vLLM's, by a plainer route: one vectorised pass finds
where the last token occurred earlier, and each longer suffix filters those candidates
(O(len(history) + max_n * candidates)), small beside a forward pass.
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
    longest = min(max_n, total - 1)
    if k == 0 or longest < min_n:
        return []
    # Candidates are the earlier positions holding the last token (occurrences end there,
    # before the last token); each round keeps those whose match extends one token back.
    ends = np.flatnonzero(tokens[: total - 1] == tokens[-1])
    best = ends[0] if min_n == 1 and len(ends) else None
    for n in range(2, longest + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[total - n]]
        if not len(ends):
            break
        if n >= min_n:
            best = ends[0]  # sorted: the earliest occurrence of the longest suffix so far
    if best is None:
        return []
    return tokens[best + 1 : best + 1 + k].tolist()

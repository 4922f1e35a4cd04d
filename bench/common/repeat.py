"""Repeat the systems of a benchmark k times, interleaved, and report ratios as a
median with their min-max.

One timing per system, taken in a fixed order, lets one stray process on a shared
machine move a ratio by 2x. Here every repetition runs each system once, in the
same order (A B A B ...), so load that drifts over the run hits every system alike;
a ratio is computed per repetition (A_i / B_i, both taken seconds apart) and the
median of those is reported with its range:

    runs = interleaved({"ours": run_ours, "hf": run_hf}, repeats=3, log=print)
    ratio = Ratio.of([o.tok_s / h.tok_s for o, h in zip(runs["ours"], runs["hf"])])
    print(f"ours/hf {ratio}")                      # 3.357 (min 3.101, max 3.512, k=3)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def interleaved(
    systems: Mapping[str, Callable[[int], T]], repeats: int, log: Callable[[str], None] | None = None
) -> dict[str, list[T]]:
    """Call every system once per repetition, in the mapping's order, `repeats`
    times; `systems[name](rep)` gets the repetition's index (0-based), e.g. to draw
    that repetition's workload. Returns each system's results in repetition order."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    results: dict[str, list[T]] = {name: [] for name in systems}
    for rep in range(repeats):
        for name, run in systems.items():
            if log is not None:
                log(f"[repeat {rep + 1}/{repeats}] {name}")
            results[name].append(run(rep))
    return results


def rotated(names: Sequence[T], rep: int) -> list[T]:
    """`names` started at position rep mod len: A B C, B C A, C A B, ... so that no
    system always runs first (on a cold cache) or right after the same neighbour."""
    shift = rep % len(names) if names else 0
    return [*names[shift:], *names[:shift]]



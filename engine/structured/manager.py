"""The engine's side of structured outputs: each constrained request's compile, and each
constrained sequence's matcher.

    admission  check(params)                 limits (ValueError naming the field)
    new group  start(group_id, constraint)   compiling starts; the group is not scheduled
    each step  poll() -> ready / failed        ready: matchers built (the resumed tokens
                                               accepted), the group may be scheduled
    drafting   valid_drafts(seq, drafts) -> a   how many drafts the grammar takes (the rest are cut)
    sampling   mask(logits, rows)             before the sampler: -inf where not allowed; a
                                               verification's K+1 rows each at its own position
    appending  accept(seq, token) -> done      the one place a token enters a matcher
    forking    fork(parent, child)             n > 1: each sample its own matcher
    the end    release(seq)

A sequence's matcher has accepted exactly the sequence's output tokens (and the
resumed ones of a migrated sequence): tokens are appended only through `accept`.
Speculative drafts only pass through it: `valid_drafts` and `mask` advance the matcher
draft by draft and roll it back before they return (on every path out).

A verification of drafts d0 .. d(K-1) (engine/spec/verify.py) samples K+1 rows; row i
is sampled as if d0 .. d(i-1) had been emitted, so it takes the grammar's mask there:

    row:    0          1               2                     K
    mask:   place      place + d0      place + d0 d1   ...   place + d0 .. d(K-1)

A draft the grammar refuses (d_i) ends the walk: row i's mask forbids d_i, so the
token sampled there is never d_i, the draft is rejected, and rows after i are never
used (left unmasked). A draft that completes the grammar ends the walk too: if it is
accepted, the sequence ends with it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.errors import FailureKind
from pdserve.engine.structured.backend import (
    CompiledGrammar, GrammarMatcher, allocate_bitmask, apply_bitmask,
)
from pdserve.engine.structured.compiler import CompileJob, GrammarCompiler, StructuredStats
from pdserve.engine.structured.params import StructuredOutputs


# What `mask` masks for one sequence: (its first logits row, its id, its drafts: none for
# one row, K for a verification's K+1 rows).
MaskRows = tuple[int, str, Sequence[int]]


@dataclass(frozen=True)
class Failed:
    """A group whose constraint did not compile: it fails alone, as `kind` says."""

    group_id: str
    kind: FailureKind
    reason: str


class StructuredOutputsManager:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self._jobs: dict[str, CompileJob] = {}  # group id -> its compile, until polled ready
        self._compiled: dict[str, CompiledGrammar] = {}  # group id -> its grammar, while it runs
        self._matchers: dict[str, GrammarMatcher] = {}  # sequence id -> its matcher

    # -- compiling ----------------------------------------------------------------------

    def check(self, constraint: StructuredOutputs) -> None:
        self.compiler.check(constraint)

    def start(self, group_id: str, constraint: StructuredOutputs) -> None:
        self._jobs[group_id] = self.compiler.submit(constraint)

    def is_pending(self, group_id: str) -> bool:
        return group_id in self._jobs

    def take_if_compiled(self, group_id: str) -> bool:
        """Whether the group's grammar has compiled already, successfully (then it is
        ready for `attach`); a refusal is left for `poll` to report."""
        job = self._jobs.get(group_id)
        if job is None or not job.future.done() or job.future.exception() is not None:
            return False
        del self._jobs[group_id]
        self._compiled[group_id] = job.future.result()
        return True

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def poll(self, now: float | None = None) -> tuple[list[str], list[Failed]]:
        """Groups whose grammar is ready now (their matchers are built by `attach`), and
        groups that failed: refused by the backend, or past their deadline."""
        now = time.monotonic() if now is None else now
        ready: list[str] = []
        failed: list[Failed] = []
        for group_id, job in list(self._jobs.items()):
            if job.future.done():
                del self._jobs[group_id]
                exc = job.future.exception()
                if exc is None:
                    self._compiled[group_id] = job.future.result()
                    ready.append(group_id)
                else:
                    self.compiler.refused("invalid")
                    reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                    failed.append(Failed(group_id, FailureKind.INVALID_CONSTRAINT, reason))
            elif now >= job.deadline:
                del self._jobs[group_id]
                self.compiler.refused("timeout")
                failed.append(Failed(group_id, FailureKind.CONSTRAINT_TIMEOUT,
                                     f"structured_outputs: the grammar did not compile within "
                                     f"structured_outputs_compile_timeout={self.compiler.timeout:g} s"))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` for any pending compile (only when the engine has nothing
        else to do)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if self._jobs:
            wait([job.future for job in self._jobs.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    # -- matchers -----------------------------------------------------------------------

    def attach(self, group_id: str, seq_id: str, resumed: Sequence[int]) -> None:
        """A sequence's matcher, having accepted `resumed` (a migrated sequence's earlier
        output). Raises ValueError when the grammar does not allow those tokens."""
        matcher = self._compiled[group_id].matcher()
        for i, token in enumerate(resumed):
            if not matcher.accept_token(token):
                raise ValueError(f"resumed_tokens: token {i} ({token}) of the resumed output does not match "
                                 f"structured_outputs")
        self._matchers[seq_id] = matcher

    def has(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def fork(self, parent_id: str, child_id: str) -> None:
        matcher = self._matchers.get(parent_id)
        if matcher is not None:
            self._matchers[child_id] = matcher.fork()

    def accept(self, seq_id: str, token: int) -> bool:
        """Advance a sequence's matcher (none: nothing to do); whether its grammar is now
        complete. Raises RuntimeError for a token the grammar does not allow (cannot happen
        for a token sampled under the mask)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            raise RuntimeError(f"structured_outputs: token {token} does not match the grammar "
                               f"(sampled without the grammar's mask?)")
        return matcher.is_terminated()

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        matcher = self._matchers.get(seq_id)
        if matcher is not None:
            matcher.rollback(num_tokens)

    def valid_drafts(self, seq_id: str, drafts: Sequence[int]) -> int:
        """How many of `drafts`, in order, the grammar takes from the sequence's place (one
        that completes the grammar is the last: nothing after it could be emitted). The
        matcher is left where it was. An unconstrained sequence keeps them all."""
        matcher = self._matchers.get(seq_id)
        return len(drafts) if matcher is None else _walk(matcher, drafts)

    def mask(self, logits: torch.Tensor, rows: Sequence[MaskRows]) -> None:
        """In place: each (first row, sequence, drafts) of a constrained sequence keeps only
        the tokens its grammar allows: at `first` the next token's, and with drafts (a
        verification's rows first .. first + K) each row's at its own position (the
        module's diagram). Other rows, and other sequences, are untouched."""
        picked = [(first, self._matchers[seq_id], drafts) for first, seq_id, drafts in rows
                  if seq_id in self._matchers]
        if not picked:
            return
        bitmask = allocate_bitmask(sum(len(drafts) + 1 for _, _, drafts in picked), self.vocab_size)
        masked: list[int] = []
        for first, matcher, drafts in picked:
            _walk(matcher, drafts, bitmask, len(masked))
            masked += range(first, first + len(drafts) + 1)
        apply_bitmask(logits, masked, bitmask)

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def forget_group(self, group_id: str) -> None:
        """The group ended (or its sequences all have matchers): drop its job and grammar."""
        self._jobs.pop(group_id, None)
        self._compiled.pop(group_id, None)

    def stats(self) -> StructuredStats:
        return self.compiler.stats()

    def check_integrity(self, live: set[str]) -> None:
        stray = set(self._matchers) - live
        if stray:
            raise RuntimeError(f"structured outputs: matchers of ended sequences {sorted(stray)[:4]}")


def _walk(matcher: GrammarMatcher, drafts: Sequence[int], bitmask: torch.Tensor | None = None, at: int = 0) -> int:
    """Advance `matcher` through `drafts` while the grammar takes them (a draft that
    completes it is the last), writing the mask of each position reached into bitmask
    rows at, at + 1, ...; then roll it back, on every path out. Returns how many drafts
    it took. Rows past the walk's end keep what they held (allocate_bitmask: all)."""
    taken = 0
    try:
        while True:
            if bitmask is not None:
                matcher.fill_bitmask(bitmask, at + taken)
            if taken == len(drafts) or not matcher.accept_token(drafts[taken]):
                return taken
            taken += 1
            if matcher.is_terminated():
                return taken
    finally:
        matcher.rollback(taken)

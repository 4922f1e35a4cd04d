"""The engine's side of structured outputs: each constrained request's compile, and each
constrained sequence's matcher.

    admission  check(params)                 limits (ValueError naming the field)
    new group  start(group_id, constraint)   compiling starts; the group is not scheduled
    each step  poll() -> ready / failed        ready: matchers built (the resumed tokens
                                               accepted), the group may be scheduled
    sampling   mask(logits, rows)             before the sampler: -inf where not allowed
    appending  accept(seq, token) -> done      the one place a token enters a matcher
    forking    fork(parent, child)             n > 1: each sample its own matcher
    the end    release(seq)

A sequence's matcher has accepted exactly the sequence's output tokens (and the
resumed ones of a migrated sequence): tokens are appended only through `accept`.
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

    def mask(self, logits: torch.Tensor, rows: Sequence[tuple[int, str]]) -> None:
        """In place: each (row, sequence) of a constrained sequence keeps only the
        tokens its grammar allows next. Other rows are untouched."""
        picked = [(row, self._matchers[seq_id]) for row, seq_id in rows if seq_id in self._matchers]
        if not picked:
            return
        bitmask = allocate_bitmask(len(picked), self.vocab_size)
        for i, (_, matcher) in enumerate(picked):
            matcher.fill_bitmask(bitmask, i)
        apply_bitmask(logits, [row for row, _ in picked], bitmask)

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

"""Fan-out and beams: the sequences a request forks off its own KV.

    n samples:  prompt prefilled once --fan_out--> n sequences sharing its blocks
    k beams:    every step, each surviving (beam, token) continues in a fork of its
                parent beam's block table; beams no longer continued are dropped

A fork shares its parent's full blocks by reference and copies the partial last
block (copy on write). When no block is free for the copy, the fork recomputes its
KV instead (prefix-cache hits make that cheap): it waits at the front of the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdserve.engine.beam import BeamStep
from pdserve.engine.group import SequenceGroup
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sampler import apply_penalties
from pdserve.engine.scheduler import Scheduler


class Forker:
    def __init__(
        self, kv: KVCacheManager, runner: ModelRunner, scheduler: Scheduler,
        track: Callable[[Request, SequenceGroup], None],
        on_sample: Callable[[Request, Request], None] | None = None,
    ) -> None:
        self.kv = kv
        self.runner = runner
        self.scheduler = scheduler
        self.track = track  # registers a new sequence with the engine
        self.on_sample = on_sample  # (parent, child): a sample forked off the prompt (a proposer's copy)

    def fork(self, group: SequenceGroup, parent: Request, sample_index: int) -> tuple[Request, bool]:
        """A new sequence continuing `parent`; whether it holds its KV now (else it
        waits to recompute)."""
        child = parent.fork(group.child_id(), sample_index)
        copies = self.kv.fork(parent, child)
        group.live.append(child)  # first: from here on, failing the group frees the child
        self.track(child, group)
        if copies is None:
            child.num_computed_tokens = 0
            self.scheduler.resume(child)
            return child, False
        self.scheduler.adopt(child)
        self.runner.copy_blocks(copies)
        return child, True

    def fan_out(self, group: SequenceGroup, parent: Request) -> list[Request]:
        """After the prompt's prefill, fork the n - 1 other samples off its KV; the
        sequences that sample from this step's logits."""
        if not group.needs_fan_out:
            return [parent]
        group.fanned_out = True
        ready = [parent]
        for index in range(1, group.params.n):
            child, has_kv = self.fork(group, parent, index)
            if self.on_sample is not None:
                self.on_sample(parent, child)
            if has_kv:
                ready.append(child)
        return ready

    @staticmethod
    def beam_log_probs(group: SequenceGroup, seq: Request, logits: torch.Tensor) -> torch.Tensor | None:
        """Keep a beam's next-token log-probs; once every live beam has them, the
        [beams, V] scores the search ranks (HF's order: log_softmax, then the logits
        processors on log-probs: repetition penalty, min_new_tokens), else None."""
        group.pending[seq.request_id] = torch.log_softmax(logits.float(), dim=-1)
        if len(group.pending) < len(group.live):
            return None  # siblings not stepped yet (not scheduled or preempted)
        log_probs = torch.stack([group.pending[b.request_id] for b in group.live])
        group.pending.clear()
        log_probs = apply_penalties(log_probs, group.live)
        if seq.num_output_tokens < group.params.min_tokens:
            eos = [t for t in group.beam.eos_token_ids if t < log_probs.shape[1]] if group.beam else []
            log_probs[:, torch.tensor(eos, dtype=torch.long, device=log_probs.device)] = float("-inf")
        return log_probs

    def reform(self, group: SequenceGroup, step: BeamStep) -> list[Request]:
        """Continue each surviving (beam, token) in a fork of its parent (the first
        continuation of a parent takes the parent itself); returns the dropped beams,
        for the caller to free."""
        beams = list(group.live)
        reused: set[int] = set()
        new_live: list[Request] = []
        for parent_index, _token in step.continuations:
            parent = beams[parent_index]
            if parent_index in reused:
                new_live.append(self.fork(group, parent, parent.sample_index)[0])
            else:
                reused.add(parent_index)
                new_live.append(parent)
        group.live = new_live
        now = time.monotonic()
        for child, (_, token) in zip(new_live, step.continuations):
            child.append_token(token)
            child.first_token_time = child.first_token_time or now
        return [beam for index, beam in enumerate(beams) if index not in reused]

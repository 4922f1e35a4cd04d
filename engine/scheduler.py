"""Continuous batching with chunked prefill and preemption by recompute.

There are no prefill and decode phases: every scheduled request moves its
`num_computed_tokens` toward `num_tokens` by up to the step's token budget, so a
long prompt is prefilled in chunks beside running decodes. Running requests go
first (oldest first); when blocks run out the newest running request is preempted
(its blocks freed, to be recomputed later). Waiting requests are admitted in
arrival order while budget, sequence slots and blocks allow.

Priority is age: `Request.priority` (the engine numbers groups by arrival, and the
sequences within them), lowest first. Running requests are scheduled oldest first,
the youngest is preempted first, and a sequence that must recompute waits behind
every older one but before every younger one, so the oldest request always makes
progress (with beams, whose sequences wait for each other, arrival order alone would
let a young request starve an old group forever).

Speculative decoding: a running request with draft tokens (`spec_token_ids`, set by
the proposer before the step) is scheduled for its last known token plus the drafts
(K+1 query tokens), and its blocks grow to hold them (K lookahead slots); drafts the
budget cannot fit are dropped, and so are drafts whose slots would need a preemption
(nobody is preempted for optional work). Verification appends only what it accepts,
and `num_computed_tokens` counts only those, so a rejected draft's slot is simply
written again by the next step; blocks that held only rejected drafts are freed.

Sequence slots (max_num_seqs) are held by groups, not sequences: a request that will
run n samples or k beams is admitted only when n (or k) slots are free, and its group
keeps them until its sequences finish, so forks never push the batch past
max_num_seqs and a preempted or forked sequence of an admitted group never waits for
a slot.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    # (request, number of tokens to compute this step), in batch order
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Preempted for their own room: even the youngest left could not make space.
    preempted_self: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._group_slots: dict[str, int] = {}  # admitted group -> sequence slots it holds
        self._num_slots = 0  # their sum

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def resume(self, request: Request) -> None:
        """A sequence of an admitted group that must (re)compute its KV: in line before
        every younger request (and before its equals), behind older ones."""
        at = next((i for i, r in enumerate(self.waiting) if _priority(r) >= _priority(request)), len(self.waiting))
        self.waiting.insert(at, request)

    def adopt(self, request: Request) -> None:
        """A sequence that already holds its blocks joins the running batch (a fork, or
        a prompt whose KV arrived from a prefill worker: its group takes its slots
        even past max_num_seqs, since its KV is already here)."""
        if request.group_id not in self._group_slots:
            self._hold_slots(request.group_id, request.sampling_params.num_seqs)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def shrink_group(self, group_id: str, num_seqs: int) -> None:
        """The group will run at most `num_seqs` sequences from now on (0: it is done)."""
        held = self._group_slots.get(group_id)
        if held is None:
            return
        keep = max(0, min(held, num_seqs))
        self._num_slots -= held - keep
        if keep:
            self._group_slots[group_id] = keep
        else:
            del self._group_slots[group_id]

    def _hold_slots(self, group_id: str, num_seqs: int) -> None:
        self._group_slots[group_id] = num_seqs
        self._num_slots += num_seqs

    @property
    def num_seq_slots(self) -> int:
        """Sequence slots held by admitted groups (at most max_num_seqs, but for adopted KV)."""
        return self._num_slots

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _chunk(self, num_remaining: int, budget: int) -> int:
        n = min(num_remaining, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap else n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for request in sorted(self.running, key=_priority):  # oldest first
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for an older one this step
            n = self._chunk(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            if n == 0:  # waiting on its group (a beam whose siblings lag behind)
                continue
            if request.spec_token_ids:  # drafts past the budget are dropped, never half scored
                del request.spec_token_ids[max(0, n - (request.num_tokens - request.num_computed_tokens)):]
                if not self.kv.allocate_slots(request, n):
                    # Drafts are optional: nobody is preempted for their lookahead slots.
                    request.spec_token_ids.clear()
                    n = request.num_tokens - request.num_computed_tokens
            if self._make_room(request, n, out):
                out.scheduled.append((request, n))
                budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _make_room(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate n slots for a running request, preempting the youngest until it fits
        (so the oldest request always makes progress)."""
        while not self.kv.allocate_slots(request, n):
            victim = max(reversed(self.running), key=_priority)  # youngest; the last of equals
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                out.preempted_self.append(victim)
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            slots = 0 if request.group_id in self._group_slots else request.sampling_params.num_seqs
            if slots and self.num_seq_slots + slots > self.config.max_num_seqs:
                break
            hits, num_hit = self.kv.get_computed_blocks(request)
            n = self._chunk(request.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(request, n, hits):
                break
            self.kv.record_lookup(request, num_hit)  # once per admission, not per failed try
            if slots:
                self._hold_slots(request.group_id, slots)
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            # prompt tokens served from the cache (usage.cached_tokens): a preempted request
            # re-admitted finds its generated tokens' blocks too, which are not prompt
            request.num_cached_tokens = max(request.num_cached_tokens, min(num_hit, request.num_prompt_tokens))
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks; it waits, in priority order, to be recomputed."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.resume(request)

    def finish(self, request: Request, status: RequestStatus, free: bool = True) -> None:
        """Take a request out of the queues and free its blocks (every path out ends
        here; `free=False` only for KV a prefill worker still has to ship). A lone
        sequence's group gives its slot back; a wider group's owner calls `shrink_group`."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free:
            self.kv.free(request.request_id)
        if request.sampling_params.num_seqs == 1:
            self.shrink_group(request.group_id, 0)

    def check_integrity(self) -> None:
        """Slot accounting adds up, and every running sequence's group holds slots."""
        if self._num_slots != sum(self._group_slots.values()):
            raise RuntimeError(f"scheduler: {self._num_slots} slots counted, {sum(self._group_slots.values())} held")
        for request in self.running:
            if request.group_id not in self._group_slots:
                raise RuntimeError(f"scheduler: {request.request_id} runs but its group holds no slots")


def _priority(request: Request) -> tuple[int, int]:
    return request.priority

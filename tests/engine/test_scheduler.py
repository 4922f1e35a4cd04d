"""Scheduling policy alone: budgets, chunking, admission order, preemption."""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler

BS = 4


def make(num_blocks: int, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(BlockPool(num_blocks), BS))


def req(rid: str, n: int, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=64), BS)


def run_step(s: Scheduler) -> dict[str, int]:
    """Pretend the model ran: advance computed tokens, append a token where one is sampled."""
    plan = s.schedule()
    for r, n in plan.scheduled:
        r.num_computed_tokens += n
        s.kv.cache_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
    return {r.request_id: n for r, n in plan.scheduled}


def test_long_prompt_is_chunked_under_the_budget():
    s = make(64, max_num_batched_tokens=10)
    s.add(req("a", 25))
    assert run_step(s) == {"a": 10}
    assert run_step(s) == {"a": 10}
    assert run_step(s) == {"a": 5}
    assert run_step(s) == {"a": 1}  # decoding now


def test_running_requests_go_first_and_mix_with_prefill():
    s = make(64, max_num_batched_tokens=8)
    s.add(req("a", 3))
    run_step(s)
    s.add(req("b", 20, first=100))
    assert run_step(s) == {"a": 1, "b": 7}


def test_max_num_seqs_limits_admission():
    s = make(64, max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 3, first=10 * i))
    assert set(run_step(s)) == {"r0", "r1"}
    assert len(s.waiting) == 1


def test_newest_request_is_preempted_when_blocks_run_out():
    s = make(4)  # 16 tokens of KV
    s.add(req("old", 8))
    s.add(req("new", 8, first=50))
    run_step(s)  # both prefilled, 4 blocks in use, each sampled a 9th token
    plan = s.schedule()
    assert [r.request_id for r in plan.preempted] == ["new"]
    assert [r.request_id for r, _ in plan.scheduled] == ["old"]
    assert s.waiting[0].request_id == "new" and s.waiting[0].num_computed_tokens == 0
    s.kv.check_integrity()


def test_finish_frees_blocks_from_any_queue():
    s = make(8)
    s.add(req("a", 5))
    s.add(req("b", 5, first=20))
    run_step(s)
    s.add(req("c", 5, first=40))
    for r in list(s.running) + list(s.waiting):
        s.finish(r, r.status)
    assert s.kv.pool.num_free_blocks == 8 and s.num_unfinished == 0
    s.kv.check_integrity()


def test_groups_hold_their_width_of_max_num_seqs():
    """A request that will run n sequences is admitted only when n slots are free, and
    its group keeps them (its forks never wait for a slot) until it shrinks."""
    s = make(64, max_num_seqs=4)
    wide = [Request(f"w{i}", list(range(10 * i, 10 * i + 3)), SamplingParams(max_tokens=8, n=3), BS) for i in range(2)]
    for r in wide:
        s.add(r)
    s.add(req("one", 3, first=40))
    assert set(run_step(s)) == {"w0"}  # w1 needs 3 more slots: 1 is free; "one" waits behind it
    assert s.num_seq_slots == 3
    fork = wide[0].fork("w0#1", 1)
    assert s.kv.fork(wide[0], fork) is not None
    s.adopt(fork)  # a fork of an admitted group: no new slot
    assert s.num_seq_slots == 3
    s.shrink_group("w0", 0)
    for r in (wide[0], fork):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert set(run_step(s)) == {"w1", "one"}
    assert s.num_seq_slots == 4
    s.check_integrity()


def test_prefix_lookup_counts_once_per_admission():
    s = make(6)  # 24 tokens of KV
    s.add(req("big", 16))
    s.add(req("waits", 12, first=30))
    for _ in range(4):
        run_step(s)  # "waits" cannot get its 3 blocks while "big" holds 5
    assert s.kv.prefix_cache_queries == 16
    s.finish(s.running[0], RequestStatus.FINISHED_LENGTH)
    run_step(s)
    assert s.kv.prefix_cache_queries == 16 + 12


def test_drafts_get_k_plus_one_tokens_and_lookahead_slots_but_never_preempt():
    s = make(4)
    a, b = req("a", 3), req("b", 3, first=50)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 3, "b": 3}  # each: 4 tokens (one sampled), one block
    a.spec_token_ids[:] = [1, 2, 3, 4, 5]
    b.spec_token_ids[:] = [1]
    plan = s.schedule()
    # a: its last token and 5 drafts (positions 3..8: three blocks, the pool is full); b's
    # one draft would need a block: dropped, b decodes its token alone, nobody preempted.
    assert {r.request_id: n for r, n in plan.scheduled} == {"a": 6, "b": 1}
    assert not plan.preempted and b.spec_token_ids == [] and len(s.kv.req_blocks["a"]) == 3
    # a's verification accepted none: it keeps its token and the target's, and the block
    # only rejected drafts held goes back; b's draft now fits.
    a.spec_token_ids.clear()
    a.num_computed_tokens += 1
    a.append_token(9)
    s.kv.trim(a)
    assert len(s.kv.req_blocks["a"]) == 2 and s.kv.pool.num_free_blocks == 1
    b.num_computed_tokens += 1
    b.append_token(9)
    b.spec_token_ids[:] = [1]
    plan = s.schedule()
    assert {r.request_id: n for r, n in plan.scheduled} == {"a": 1, "b": 2}
    assert not plan.preempted and not s.num_preemptions


def test_cached_tokens_count_prompt_tokens_only_after_a_preemption():
    """A preempted request re-admitted finds its own blocks again, generated tokens
    included; what it reports as served from the prefix cache is prompt tokens only
    (usage.cached_tokens <= usage.prompt_tokens, as every client checks)."""
    s = make(64)
    r = req("a", 4)
    s.add(r)
    for _ in range(6):  # prompt prefilled, then decoding: its second block fills with generated tokens
        run_step(s)
    assert r.num_tokens >= 9
    s.running.remove(r)  # as preempt() does: blocks freed (and kept cached), back to waiting
    s.kv.free(r.request_id)
    r.num_computed_tokens = 0
    r.status = RequestStatus.WAITING
    s.waiting.appendleft(r)
    run_step(s)
    assert r.num_computed_tokens >= 8  # two full blocks found again (the second: generated tokens), then more
    assert r.num_cached_tokens == r.num_prompt_tokens == 4

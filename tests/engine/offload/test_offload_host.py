"""The host-memory tier (engine/offload/host.py): slots, states, eviction, integrity."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.offload.host import HostTier
from pdserve.engine.offload.policy import make_policy
from offload_helpers import LAYOUT, block_data, block_hash, tokens


def tier(slots: int = 3, policy: str = "lru") -> HostTier:
    return HostTier(slots, LAYOUT, torch.float32, make_policy(policy, slots))


def put(t: HostTier, i: int):
    got = t.begin_write(block_hash(i), tokens(i))
    assert got is not None
    slot, victim = got
    t.store[slot].copy_(block_data(i))
    t.end_write(block_hash(i), True)
    return victim


def test_a_block_is_found_only_once_written() -> None:
    t = tier()
    slot, _ = t.begin_write(block_hash(1), tokens(1))
    assert t.acquire(block_hash(1), tokens(1)) is None  # being written: never served
    assert not t.contains(block_hash(1))
    t.store[slot].copy_(block_data(1))
    t.end_write(block_hash(1), True)
    got = t.acquire(block_hash(1), tokens(1))
    assert got == slot and torch.equal(t.store[got], block_data(1))
    t.release(block_hash(1))
    t.check_integrity()
    s = t.stats()
    assert (s.hits, s.misses, s.used_blocks, s.capacity_blocks) == (1, 1, 1, 3)


def test_other_tokens_under_the_same_hash_miss() -> None:
    t = tier()
    put(t, 1)
    assert t.acquire(block_hash(1), tokens(2)) is None


def test_full_tier_evicts_by_policy_and_hands_the_victim_back() -> None:
    t = tier(2)
    put(t, 1)
    put(t, 2)
    t.acquire(block_hash(1), tokens(1))
    t.release(block_hash(1))  # 1 is now more recent than 2
    victim = put(t, 3)
    assert victim is not None and victim.block_hash == block_hash(2) and victim.token_ids == tokens(2)
    assert not t.contains(block_hash(2)) and t.contains(block_hash(1)) and t.contains(block_hash(3))
    t.check_integrity()
    assert t.stats().evicted == 1


def test_pinned_and_half_written_blocks_are_never_evicted() -> None:
    t = tier(2)
    put(t, 1)
    t.begin_write(block_hash(2), tokens(2))  # being written
    assert t.acquire(block_hash(1), tokens(1)) is not None  # pinned by a reader
    assert t.begin_write(block_hash(3), tokens(3)) is None  # nothing evictable
    with pytest.raises(RuntimeError, match="pinned or half written"):
        t.check_integrity()
    t.check_integrity(idle=False)
    t.release(block_hash(1))
    t.end_write(block_hash(2), False)  # a failed write frees its slot
    t.check_integrity()
    assert t.stats().used_blocks == 1


def test_a_block_already_here_is_not_written_again() -> None:
    t = tier()
    put(t, 1)
    assert t.begin_write(block_hash(1), tokens(1)) is None


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_churn_leaks_no_slot(policy: str) -> None:
    t = tier(4, policy)
    for i in range(50):
        if not t.contains(block_hash(i % 11)):
            put(t, i % 11)
        if i % 3 == 0 and t.acquire(block_hash(i % 7), tokens(i % 7)) is not None:
            t.release(block_hash(i % 7))
        t.check_integrity()
    assert t.stats().used_blocks == 4


def test_integrity_check_finds_a_double_owned_slot() -> None:
    t = tier()
    put(t, 1)
    put(t, 2)
    t._entries[block_hash(2)].slot = t._entries[block_hash(1)].slot  # corrupt the accounting
    with pytest.raises(RuntimeError, match="owned by two"):
        t.check_integrity()


def test_no_room_for_one_block_names_the_flag() -> None:
    with pytest.raises(ValueError, match="kv_offload_host_bytes"):
        HostTier(0, LAYOUT, torch.float32, make_policy("lru", 1))

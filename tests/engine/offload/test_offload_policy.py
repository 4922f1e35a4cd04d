"""Eviction policies of the lower KV tiers (engine/offload/policy.py)."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.offload.policy import ARCPolicy, LRUPolicy, make_policy


def fill(policy, keys):
    for k in keys:
        policy.insert(k)


def evict(policy, ok=lambda k: True):
    key = policy.victim(ok)
    if key is not None:
        policy.evicted(key)
    return key


def test_lru_evicts_least_recently_used_and_skips_pinned() -> None:
    p = LRUPolicy(3)
    fill(p, "abc")
    p.touch("a")
    assert evict(p) == "b"
    assert evict(p, lambda k: k != "c") == "a"
    assert evict(p) == "c"
    assert evict(p) is None and len(p) == 0


def test_lru_remove_and_contains() -> None:
    p = LRUPolicy(2)
    fill(p, "ab")
    p.remove("a")
    assert "a" not in p and "b" in p and len(p) == 1


def test_arc_keeps_blocks_hit_twice_through_a_scan() -> None:
    """A scan of one-off blocks flushes LRU's hot blocks; ARC keeps them in T2."""
    hot = ["h1", "h2"]
    kept = {}
    for name in ("lru", "arc"):
        p = make_policy(name, 4)
        fill(p, hot)
        for h in hot:
            p.touch(h)  # hit again
        for i in range(8):  # a scan: each new block needs room
            if len(p) >= 4:
                evict(p)
            p.insert(f"scan{i}")
        kept[name] = [h for h in hot if h in p]
    assert kept["lru"] == []
    assert kept["arc"] == hot


def test_arc_ghost_hit_adapts_and_promotes() -> None:
    p = ARCPolicy(2)
    fill(p, ["a", "b"])
    assert evict(p) == "a"  # T1's oldest, now a ghost in B1
    assert "a" in p.b1 and "a" not in p
    p.insert("a")  # a ghost hit: T1 should have been larger
    assert p.p > 0 and "a" in p.t2


def test_arc_remove_forgets_ghosts_too() -> None:
    p = ARCPolicy(2)
    fill(p, ["a", "b"])
    evict(p)
    p.remove("a")
    assert "a" not in p.b1


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_random_operations_keep_sizes_bounded(name: str) -> None:
    rng = random.Random(3)
    cap = 5
    p = make_policy(name, cap)
    resident: set[int] = set()
    for _ in range(2000):
        key = rng.randrange(20)
        op = rng.random()
        if op < 0.5 and key not in resident:
            if len(resident) >= cap:
                victim = evict(p)
                resident.discard(victim)
            p.insert(key)
            resident.add(key)
        elif op < 0.8:
            p.touch(key)
        elif key in resident:
            p.remove(key)
            resident.discard(key)
        assert len(p) == len(resident) <= cap
        assert all(k in p for k in resident)
        if isinstance(p, ARCPolicy):
            assert len(p.b1) + len(p.b2) <= cap


def test_unknown_policy_names_the_flag() -> None:
    with pytest.raises(ValueError, match="kv_offload_policy"):
        make_policy("mru", 3)

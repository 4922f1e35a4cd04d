"""The block pool and the per-request KV view, alone on a CPU."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), BS)


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert blocks is not None and pool.num_free_blocks == 3
    assert pool.allocate(4) is None and pool.num_free_blocks == 3  # all or nothing
    pool.free(blocks)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_double_free_is_refused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="ref_cnt"):
        pool.free([block])


def test_lru_evicts_oldest_cached_block_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in zip((a, b, c), (b"a", b"b", b"c")):
        pool.cache(blk, h, [1])
    pool.free([a])
    pool.free([b])
    pool.free([c])
    (fresh,) = pool.allocate(1)
    assert fresh is a and pool.lookup(b"a", [1]) is None
    assert pool.lookup(b"b", [1]) is b and pool.lookup(b"c", [1]) is c
    pool.check_integrity()


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"a", [1])
    pool.free([a, b])
    (fresh,) = pool.allocate(1)
    assert fresh is b and pool.lookup(b"a", [1]) is a


def test_lookup_compares_tokens_so_collisions_miss():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h", [1, 2])
    assert pool.lookup(b"h", [1, 2]) is a
    assert pool.lookup(b"h", [1, 3]) is None


def test_cache_hit_on_free_block_takes_it_out_of_the_queue():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks
    first = make_request("a", tokens)
    assert kv.allocate_slots(first, 13)
    first.num_computed_tokens = 13
    kv.cache_full_blocks(first)
    kv.free("a")
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    second = make_request("b", tokens)
    hits, n = kv.get_computed_blocks(second)
    assert n == 12 and len(hits) == 3
    assert kv.allocate_slots(second, 1, hits)
    assert pool.num_free_blocks == 0
    kv.check_integrity()
    kv.free("b")
    kv.check_integrity()


def test_hit_is_capped_so_the_last_token_is_computed():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    tokens = list(range(8))  # exactly two full blocks
    req = make_request("a", tokens)
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    kv.cache_full_blocks(req)
    kv.free("a")
    again = make_request("b", tokens)
    hits, n = kv.get_computed_blocks(again)
    assert n == 4 and len(hits) == 1  # the last block is recomputed for its logits


def test_allocation_failure_changes_nothing():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    req = make_request("a", list(range(20)))
    assert not kv.allocate_slots(req, 20)
    assert pool.num_free_blocks == 3 and "a" not in kv.req_blocks
    kv.check_integrity()


def test_random_operations_keep_integrity():
    rng = random.Random(0)
    pool = BlockPool(32)
    kv = KVCacheManager(pool, BS)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: dict[str, Request] = {}
    for step in range(400):
        if live and rng.random() < 0.4:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        else:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            req = make_request(rid, tokens)
            hits, n = kv.get_computed_blocks(req)
            req.num_computed_tokens = 0
            if kv.allocate_slots(req, len(tokens) - n, hits):
                req.num_computed_tokens = len(tokens)
                kv.cache_full_blocks(req)
                live[rid] = req
        kv.check_integrity()
    for rid in list(live):
        kv.free(rid)
    kv.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_integrity_check_catches_a_leak():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    kv.req_blocks["a"].pop()  # lose track of a referenced block
    with pytest.raises(RuntimeError, match="ref_cnt"):
        kv.check_integrity()


def test_request_block_hashes_follow_appended_tokens():
    req = make_request("a", list(range(6)))
    assert req.block_hashes == hash_blocks(list(range(6)), BS)
    req.append_token(6)
    req.append_token(7)
    assert req.block_hashes == hash_blocks(list(range(8)), BS)

"""KVCacheManager.fragmentation: allocated slots holding no token / allocated slots,
each physical block counted once (the `pdserve:kv_cache_fragmentation` gauge)."""

from __future__ import annotations

import random

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), BS)


def by_walking_every_block(kv: KVCacheManager) -> float:
    """The definition, block by block: the most tokens any holder keeps in a block."""
    filled: dict[int, int] = {}
    for rid, blocks in kv.req_blocks.items():
        request = kv._requests[rid]
        tokens = max(request.num_computed_tokens, request.num_cached_tokens)
        for i, block in enumerate(blocks):
            filled[block.block_id] = max(filled.get(block.block_id, 0), min(BS, max(0, tokens - i * BS)))
    slots = len(filled) * BS
    return (slots - sum(filled.values())) / slots if slots else 0.0


def test_nothing_allocated_is_no_fragmentation():
    kv = KVCacheManager(BlockPool(8), BS)
    assert kv.fragmentation() == 0.0


def test_empty_slots_of_partial_and_reserved_blocks():
    kv = KVCacheManager(BlockPool(8), BS)
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6)  # 2 blocks, nothing computed yet
    assert kv.fragmentation() == 1.0
    req.num_computed_tokens = 6  # 6 of 8 slots hold a token
    assert kv.fragmentation() == 2 / 8
    kv.free("a")
    assert kv.fragmentation() == 0.0


def test_shared_prefix_blocks_count_once():
    """Two requests share two cached blocks: 2 + 1 + 1 blocks, 16 slots, 8 + 1 + 3 tokens."""
    kv = KVCacheManager(BlockPool(8), BS)
    prefix = list(range(8))
    first = make_request("a", prefix + [100])
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_full_blocks(first)
    second = make_request("b", prefix + [200, 201, 202])
    hits, n = kv.get_computed_blocks(second)
    assert n == 8
    assert kv.allocate_slots(second, 3, hits)
    second.num_computed_tokens = 11
    assert kv.fragmentation() == (16 - 12) / 16 == by_walking_every_block(kv)
    kv.check_integrity()


def test_a_reservations_prefix_hits_hold_tokens_before_its_kv_arrives():
    kv = KVCacheManager(BlockPool(8), BS)
    prompt = list(range(9))
    first = make_request("a", prompt)
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_full_blocks(first)
    kv.free("a")
    reserved = make_request("r", prompt)  # the decode side: hits, the rest awaits remote KV
    hits, n = kv.get_computed_blocks(reserved)
    assert kv.allocate_slots(reserved, 9 - n, hits)
    reserved.num_cached_tokens = n
    assert kv.fragmentation() == (12 - 8) / 12


def test_forked_sequences_share_full_blocks_and_copy_the_partial_one():
    kv = KVCacheManager(BlockPool(8), BS)
    parent = make_request("p", list(range(6)))
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork("c", 1)
    assert kv.fork(parent, child) is not None
    # 1 shared full block + 2 partial ones (2 tokens each): 12 slots, 8 tokens
    assert kv.fragmentation() == 4 / 12 == by_walking_every_block(kv)
    kv.check_integrity()


def test_random_operations_agree_with_the_definition():
    rng = random.Random(1)
    pool = BlockPool(32)
    kv = KVCacheManager(pool, BS)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[str] = []
    for step in range(300):
        if live and rng.random() < 0.4:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            req = make_request(f"r{step}", tokens)
            hits, n = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, len(tokens) - n + rng.randrange(3), hits):  # some lookahead slots
                req.num_computed_tokens = rng.randrange(n, len(tokens) + 1)
                kv.cache_full_blocks(req)
                live.append(req.request_id)
        assert abs(kv.fragmentation() - by_walking_every_block(kv)) < 1e-12
        kv.check_integrity()

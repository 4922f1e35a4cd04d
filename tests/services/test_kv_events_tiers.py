"""KV events that name the tier (issue 36): the engine's log carries what its host and
disk tiers stored and dropped, the worker's stream carries it as `lower`, the router's
view follows it per tier, and the routing policy weighs a hit by its tier (device over
host over disk over a miss). Without tiers nothing of it is sent."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from engine_helpers import one_thread  # noqa: F401  (a fixture: one torch thread)
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.kv_events import KvEventBatch, KvEventLog, TierChanges
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router import policy
from pdserve.services.router.kv_view import KvView
from pdserve.services.worker import kv_events as worker_kv

BS = 16


def h(k: int) -> bytes:
    return k.to_bytes(32, "little")


# -- the log ---------------------------------------------------------------------------------------


def test_tier_changes_from_another_thread_ride_in_the_next_batch():
    log = KvEventLog()
    log.stored(h(1))
    writer = threading.Thread(target=lambda: [log.tier_changed("host", h(k), True) for k in (1, 2, 3)])
    writer.start()
    writer.join(10)
    log.tier_changed("disk", h(2), True)
    assert log.flush() == 1
    (batch,) = log.since(0, log.epoch)
    assert batch.stored == (h(1),)
    assert {c.tier: set(c.stored) for c in batch.lower} == {"host": {h(1), h(2), h(3)}, "disk": {h(2)}}
    log.tier_changed("host", h(3), False)
    log.tier_changed("host", h(4), True)
    log.tier_changed("host", h(4), False)  # stored and dropped before the flush: cancels out
    assert log.flush() == 2
    (batch,) = log.since(1, log.epoch)
    assert batch.stored == batch.removed == () and batch.lower == (TierChanges("host", (), (h(3),)),)
    log.tier_changed("disk", h(9), True)
    assert log.flush() == 3  # a batch with only a lower tier's change
    (snapshot,) = log.since(0, "")
    assert set(snapshot.stored) == {h(1)}
    assert {c.tier: set(c.stored) for c in snapshot.lower} == {"host": {h(1), h(2)}, "disk": {h(2), h(9)}}


def test_a_log_without_tiers_sends_what_it_sent_before():
    log = KvEventLog()
    log.stored(h(1))
    log.flush()
    (snapshot,) = log.since(0, "")
    assert snapshot.lower == ()
    (message,) = worker_kv.messages(snapshot, log.epoch)
    assert not message.lower and list(message.stored) == [h(1)]
    assert message.SerializeToString() == pb.KvEventBatch(seq=1, epoch=log.epoch, stored=[h(1)], snapshot=True,
                                                          more=False).SerializeToString()


# -- the stream's messages and the router's view -----------------------------------------------------


def test_a_delta_names_each_tier():
    batch = KvEventBatch(4, (h(1),), (h(2),), lower=(TierChanges("host", (h(2),), (h(3),)),
                                                      TierChanges("disk", (h(3),))))
    (message,) = worker_kv.messages(batch, "e")
    assert [(c.tier, list(c.stored), list(c.removed)) for c in message.lower] == [
        (pb.KV_TIER_HOST, [h(2)], [h(3)]), (pb.KV_TIER_DISK, [h(3)], [])]
    view = KvView()
    assert view.apply(pb.KvEventBatch(seq=3, epoch="e", stored=[h(2)],
                                      lower=[pb.KvTierChanges(tier=pb.KV_TIER_HOST, stored=[h(3)])], snapshot=True))
    assert view.apply(message)
    assert view.hashes == {h(1)} and view.tier(pb.KV_TIER_HOST) == {h(2)} and view.tier(pb.KV_TIER_DISK) == {h(3)}


def test_a_snapshot_sends_each_tier_in_parts_and_the_view_swaps_all_at_once():
    device = tuple(h(k) for k in range(worker_kv.SNAPSHOT_PART + 1))
    host = tuple(h(10**6 + k) for k in range(worker_kv.SNAPSHOT_PART + 2))
    batch = KvEventBatch(7, device, snapshot=True, lower=(TierChanges("host", host), TierChanges("disk", ())))
    parts = list(worker_kv.messages(batch, "e"))
    assert [(len(p.stored), [(c.tier, len(c.stored)) for c in p.lower]) for p in parts] == [
        (worker_kv.SNAPSHOT_PART, []), (1, []), (0, [(pb.KV_TIER_HOST, worker_kv.SNAPSHOT_PART)]),
        (0, [(pb.KV_TIER_HOST, 2)]), (0, [(pb.KV_TIER_DISK, 0)])]
    assert [p.more for p in parts] == [True] * 4 + [False] and {p.seq for p in parts} == {7}
    view = KvView()
    view.lower = {pb.KV_TIER_HOST: {h(5)}}  # an old view: replaced whole by the snapshot
    for p in parts[:-1]:
        assert view.apply(p)
    assert view.tier(pb.KV_TIER_HOST) == {h(5)} and view.seq == 0  # not swapped in before the last part
    assert view.apply(parts[-1])
    assert view.hashes == set(device) and view.tier(pb.KV_TIER_HOST) == set(host)
    assert view.tier(pb.KV_TIER_DISK) == set() and view.seq == 7


# -- a real engine with tiers ---------------------------------------------------------------------------


def test_a_view_following_an_engine_with_tiers_holds_each_tiers_blocks(one_thread, tmp_path: Path):
    """A pool of 24 blocks, a host tier of about 12 blocks and a disk tier below it:
    prompts that evict one another; the view rebuilt from the stream equals the pool's
    cache and each tier's content after every iteration, and saw blocks in both tiers."""
    engine = LLMEngine(EngineConfig(
        model=DEFAULT_MODEL, cache=CacheConfig(block_size=BS, num_blocks=24),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        kv_offload_host_bytes=12 * engine_block_bytes(), kv_offload_dir=str(tmp_path),
        kv_offload_disk_bytes=1 << 26,
    ))
    log, view = engine.kv_events, KvView()
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(6)]
    seen = {pb.KV_TIER_HOST: False, pb.KV_TIER_DISK: False}
    try:
        for i in range(18):
            engine.add_request(f"r{i}", rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(5)],
                               SamplingParams(max_tokens=3, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            assert engine.offload.flush(30)
            log.flush()
            for batch in log.since(view.seq, view.epoch):
                for message in worker_kv.messages(batch, log.epoch):
                    assert view.apply(message)
            host = {block_hash for block_hash, _, _ in engine.offload.host.ready_blocks()}
            assert view.hashes == set(engine.cached_block_hashes())
            assert view.tier(pb.KV_TIER_HOST) == host
            disk = view.tier(pb.KV_TIER_DISK)
            assert len(disk) == engine.offload.disk.stats().used_blocks
            assert all(engine.offload.disk.contains(block_hash) for block_hash in disk)
            seen = {tier: seen[tier] or bool(view.tier(tier)) for tier in seen}
        assert all(seen.values())
        assert engine.stats().kv_offload.host.evicted > 0  # the host tier was full: blocks went down to disk
    finally:
        engine.close()


def engine_block_bytes() -> int:
    from pdserve.engine.memory import plan_memory

    return plan_memory(DEFAULT_MODEL, block_size=BS, num_blocks=1).kv_cache_bytes


# -- the routing policy ---------------------------------------------------------------------------------


def load(wid: str, device=(), host=(), disk=(), inflight: int = 0, waiting: int = 0) -> policy.Load:
    return policy.Load(wid, inflight, 0, waiting, 10, frozenset(device), frozenset(host), frozenset(disk))


HASHES = [h(k) for k in range(4)]


def test_a_host_hit_scores_below_a_device_hit_and_above_a_miss_and_disk_below_host():
    scores = [policy.prefix_score(HASHES, w, BS) for w in (
        load("device", device=HASHES), load("host", host=HASHES), load("disk", disk=HASHES), load("miss"))]
    assert scores[0] > scores[1] > scores[2] > scores[3] == 0
    assert scores == [4 * BS, 4 * BS * policy.HOST_WEIGHT, 4 * BS * policy.DISK_WEIGHT, 0]
    mixed = load("mixed", device=HASHES[:2], host=HASHES[1:3], disk=HASHES)  # each block by its fastest tier
    assert policy.prefix_score(HASHES, mixed, BS) == BS * (2 + policy.HOST_WEIGHT + policy.DISK_WEIGHT)
    gap = load("gap", device=[HASHES[0], HASHES[2], HASHES[3]])  # the run stops at the first block in no tier
    assert policy.prefix_score(HASHES, gap, BS) == BS


@pytest.mark.parametrize("better, worse", [("device", "host"), ("host", "disk"), ("disk", "miss")])
def test_both_picks_prefer_the_faster_tier(better: str, worse: str):
    tiers = {"device": load("device", device=HASHES), "host": load("host", host=HASHES),
             "disk": load("disk", disk=HASHES), "miss": load("miss")}
    for order in ((tiers[better], tiers[worse]), (tiers[worse], tiers[better])):
        assert policy.pick_decode(order, HASHES, BS).worker_id == better
        assert policy.pick_prefill(order, HASHES, BS, queue_weight=1).worker_id == better


def test_a_longer_host_prefix_can_beat_a_short_device_one():
    short_device = load("a", device=HASHES[:1])
    long_host = load("b", host=HASHES)
    assert policy.pick_prefill([short_device, long_host], HASHES, BS, queue_weight=1).worker_id == "b"


def test_the_local_prefill_choice_counts_every_tier_as_the_reservation_does():
    assert policy.cached_prefix_tokens(HASHES, {HASHES[0]}, BS) == BS
    assert policy.cached_prefix_tokens(HASHES, {HASHES[0]}, BS, {HASHES[1]}, {HASHES[2], HASHES[3]}) == 4 * BS

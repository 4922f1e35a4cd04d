"""KV events: the engine's log of what its prefix cache stored and removed, the
worker's stream of it, and the router's view rebuilt from it: each alone, then a real
router following a real worker (gRPC on loopback) through requests, evictions and a
restart of the worker."""

from __future__ import annotations

import random
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from cluster_helpers import wait_for
from pdserve.engine import SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_events import KvEventBatch, KvEventLog
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.request import Request
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.kv_view import KvSubscriber, KvView
from pdserve.services.router.main import Router
from pdserve.services.worker import kv_events as worker_kv
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.node import Worker

BS = 4


def h(k: int) -> bytes:
    return k.to_bytes(32, "little")


class Replay:
    """A subscriber that applies what `since` gives it, as the router does."""

    def __init__(self, log: KvEventLog) -> None:
        self.log = log
        self.hashes: set[bytes] = set()
        self.seq, self.epoch = 0, ""
        self.snapshots = 0
        self.removed = 0  # hashes removed by deltas (evictions seen)

    def catch_up(self) -> None:
        for batch in self.log.since(self.seq, self.epoch):
            if batch.snapshot:
                self.hashes = set(batch.stored)
                self.snapshots += 1
            else:
                assert batch.seq == self.seq + 1 and not set(batch.stored) & set(batch.removed)
                assert not set(batch.stored) & self.hashes and set(batch.removed) <= self.hashes
                self.hashes.difference_update(batch.removed)
                self.hashes.update(batch.stored)
                self.removed += len(batch.removed)
            self.seq, self.epoch = batch.seq, self.log.epoch


# -- the log -------------------------------------------------------------------------------


def test_batches_are_numbered_and_a_new_subscriber_gets_a_snapshot_first():
    log = KvEventLog()
    assert log.flush() is None and log.seq == 0  # nothing changed: no batch
    log.stored(h(1))
    log.stored(h(2))
    assert log.flush() == 1
    log.removed(h(1))
    log.stored(h(3))
    assert log.flush() == 2
    (snapshot,) = log.since(0, "")  # a stranger: the whole cache
    assert snapshot.snapshot and snapshot.seq == 2 and set(snapshot.stored) == {h(2), h(3)}
    assert log.since(0, log.epoch) == [KvEventBatch(1, (h(1), h(2))), KvEventBatch(2, (h(3),), (h(1),))]
    assert log.since(1, log.epoch) == [KvEventBatch(2, (h(3),), (h(1),))]
    assert log.since(2, log.epoch) == []  # up to date
    assert log.since(1, "another-process")[0].snapshot  # a restarted worker's subscriber
    assert log.since(7, log.epoch)[0].snapshot  # ahead of the log: cannot be ours


def test_a_hash_stored_and_evicted_before_the_flush_cancels_out():
    log = KvEventLog()
    log.stored(h(1))
    log.flush()
    log.stored(h(2))
    log.removed(h(2))  # came and went: the subscribers never knew it
    log.removed(h(1))
    log.stored(h(1))  # went and came back: no change either
    assert log.flush() is None
    log.removed(h(1))
    assert log.flush() == 2 and log.since(1, log.epoch) == [KvEventBatch(2, (), (h(1),))]


def test_a_subscriber_behind_the_bounded_buffer_gets_a_snapshot():
    log = KvEventLog(capacity=3)
    for k in range(1, 6):
        log.stored(h(k))
        if k > 1:
            log.removed(h(k - 1))
        log.flush()
    assert [b.seq for b in log.since(2, log.epoch)] == [3, 4, 5]  # the oldest batch kept is 3
    (snapshot,) = log.since(1, log.epoch)  # batch 2 is gone
    assert snapshot == KvEventBatch(5, (h(5),), snapshot=True)
    with pytest.raises(ValueError, match="capacity"):
        KvEventLog(capacity=0)


def test_wait_returns_when_a_batch_is_flushed_or_the_log_closes():
    log = KvEventLog()
    assert not log.wait(0, timeout=0.01)
    flushed = threading.Event()

    def flush_later():
        log.stored(h(1))
        log.flush()
        flushed.set()

    timer = threading.Timer(0.05, flush_later)
    timer.start()
    assert log.wait(0, timeout=30) and flushed.is_set()
    log.close()
    assert not log.wait(1, timeout=30) and log.closed  # returns at once: nothing after 1, ever


# -- the block pool records ----------------------------------------------------------------


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), BS)


def test_the_pool_records_stores_evictions_and_resets():
    pool = BlockPool(2)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(9)))  # two full blocks, one partial
    assert kv.allocate_slots(a, 9) is False  # three blocks needed, two in the pool
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    assert pool.events.flush() == 1
    assert pool.events.since(0, pool.events.epoch)[0].stored == tuple(a.block_hashes)
    kv.free("a")  # freed, still cached: no event
    assert pool.events.flush() is None
    b = make_request("b", [99, 98, 97, 96, 95])
    assert kv.allocate_slots(b, 5)  # takes both free blocks: evicts a's
    assert pool.events.flush() == 2
    assert set(pool.events.since(1, pool.events.epoch)[0].removed) == set(a.block_hashes)
    b.num_computed_tokens = 5
    kv.cache_full_blocks(b)
    pool.reset_cache()
    assert pool.events.flush() is None  # b's block came and went within one flush
    kv.free("b")


def cached(pool: BlockPool) -> set[bytes]:
    return {b.block_hash for b in pool.blocks if b.block_hash is not None}


def test_replayed_events_match_the_pool_under_random_operations():
    rng = random.Random(1)
    pool = BlockPool(24)
    kv = KVCacheManager(pool, BS)
    follower, laggard = Replay(pool.events), Replay(pool.events)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    live: dict[str, Request] = {}
    for step in range(600):
        if live and rng.random() < 0.45:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
            req = make_request(f"r{step}", tokens)
            hits, n = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, len(tokens) - n, hits):
                req.num_computed_tokens = len(tokens)
                kv.cache_full_blocks(req)
                live[req.request_id] = req
        if rng.random() < 0.02:
            pool.reset_cache()
        if rng.random() < 0.7:  # some iterations flush together
            pool.events.flush()
            follower.catch_up()
            assert follower.hashes == cached(pool)
        if step % 97 == 0:  # reads rarely, but within the batches kept: replays, no snapshot
            laggard.catch_up()
    pool.events.flush()
    follower.catch_up()
    laggard.catch_up()
    assert follower.hashes == laggard.hashes == cached(pool)
    assert follower.snapshots == laggard.snapshots == 1  # only the first subscription's
    assert pool.events.seq > 100 and follower.removed > 50  # it did evict


def test_caching_off_records_nothing():
    pool = BlockPool(8, enable_caching=False)
    kv = KVCacheManager(pool, BS)
    for k in range(20):
        req = make_request(f"r{k}", [k % 3] * 9)
        assert kv.allocate_slots(req, 9)
        req.num_computed_tokens = 9
        kv.cache_full_blocks(req)
        kv.free(req.request_id)
    pool.reset_cache()
    assert pool.events.flush() is None and pool.events.seq == 0


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_events_replayed_rebuild_the_engines_cache_after_a_random_workload(one_thread):
    """Shared prefixes, n > 1, a pool small enough to evict and preempt; the loop's
    flush after every step; a subscriber that keeps up and one that reads rarely from
    a small buffer (so it resyncs by snapshot) both end with the engine's own set."""
    engine = LLMEngine(EngineConfig(
        model=DEFAULT_MODEL, cache=CacheConfig(block_size=16, num_blocks=40),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256),
    ))
    engine.pool.events = log = KvEventLog(capacity=8)
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 70))] for _ in range(4)]
    follower, laggard = Replay(log), Replay(log)
    submitted = steps = 0
    while submitted < 24 or engine.has_unfinished():
        while submitted < 24 and rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
            params = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0, n=rng.choice((1, 1, 2)))
            engine.add_request(f"r{submitted}", prompt, params)
            submitted += 1
        if engine.has_unfinished():
            engine.step()
            steps += 1
        log.flush()
        follower.catch_up()
        assert follower.hashes == set(engine.cached_block_hashes())
        if steps % 25 == 0:
            laggard.catch_up()
    engine.check_integrity()
    laggard.catch_up()
    assert laggard.hashes == follower.hashes == set(engine.cached_block_hashes())
    assert log.seq > 8 and laggard.snapshots > 1 and follower.snapshots == 1
    assert follower.removed > 0, "the workload never evicted a cached block"


# -- the stream's messages and the router's view ---------------------------------------------


def test_a_large_snapshot_travels_in_parts_and_the_view_reassembles_it():
    hashes = tuple(h(k) for k in range(2 * worker_kv.SNAPSHOT_PART + 5))
    parts = list(worker_kv.messages(KvEventBatch(9, hashes, snapshot=True), "e1"))
    assert [len(p.stored) for p in parts] == [worker_kv.SNAPSHOT_PART, worker_kv.SNAPSHOT_PART, 5]
    assert [p.more for p in parts] == [True, True, False] and {p.seq for p in parts} == {9}
    view = KvView()
    for p in parts[:-1]:
        assert view.apply(p)
    assert view.hashes == set() and view.seq == 0  # not swapped in before the last part
    assert view.apply(parts[-1])
    assert view.hashes == set(hashes) and (view.seq, view.epoch) == (9, "e1")
    (empty,) = worker_kv.messages(KvEventBatch(0, (), snapshot=True), "e2")
    assert empty.snapshot and not empty.more and not empty.stored


def test_the_view_applies_deltas_in_order_and_refuses_a_gap():
    view = KvView()
    assert view.apply(pb.KvEventBatch(seq=3, epoch="e", stored=[h(1), h(2)], snapshot=True))
    assert view.apply(pb.KvEventBatch(seq=4, epoch="e", stored=[h(3)], removed=[h(1)]))
    assert view.hashes == {h(2), h(3)} and view.seq == 4
    assert not view.apply(pb.KvEventBatch(seq=6, epoch="e", stored=[h(9)]))  # 5 is missing
    assert not view.apply(pb.KvEventBatch(seq=5, epoch="other", stored=[h(9)]))  # another process's
    assert not view.apply(pb.KvEventBatch(seq=4, epoch="e", stored=[h(9)]))  # a repeat
    assert view.hashes == {h(2), h(3)}  # nothing applied
    view.forget_position()
    assert (view.seq, view.epoch) == (0, "") and view.hashes == {h(2), h(3)}  # kept until the snapshot
    assert view.apply(pb.KvEventBatch(seq=8, epoch="f", stored=[h(5)], snapshot=True))
    assert view.hashes == {h(5)}


def test_the_worker_stream_resumes_or_resyncs_and_ends_when_the_log_closes():
    log = KvEventLog()
    log.stored(h(1))
    log.flush()

    class Context:
        def is_active(self) -> bool:
            return True

    def first(since_seq: int, epoch: str) -> pb.KvEventBatch:
        return next(worker_kv.kv_event_stream(log, pb.KvEventsRequest(since_seq=since_seq, epoch=epoch), Context()))

    assert first(0, "").snapshot and first(0, "").seq == 1
    log.stored(h(2))
    log.flush()
    resumed = first(1, log.epoch)
    assert not resumed.snapshot and resumed.seq == 2 and list(resumed.stored) == [h(2)]
    stream = worker_kv.kv_event_stream(log, pb.KvEventsRequest(since_seq=2, epoch=log.epoch), Context())
    threading.Timer(0.05, log.close).start()
    assert list(stream) == []  # nothing new, then the worker stopped: the stream ends


class GappyWorker(pb_grpc.WorkerServicer):
    """A worker whose first stream skips a batch (as a bug or a lost message would):
    the subscriber must notice and resubscribe for a snapshot."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, str]] = []

    def KvEvents(self, request, context):
        self.requests.append((request.since_seq, request.epoch))
        if len(self.requests) == 1:
            yield pb.KvEventBatch(seq=1, epoch="e", stored=[h(1)], snapshot=True)
            yield pb.KvEventBatch(seq=2, epoch="e", stored=[h(2)])
            yield pb.KvEventBatch(seq=4, epoch="e", stored=[h(4)])  # 3 is missing
        else:
            yield pb.KvEventBatch(seq=4, epoch="e", stored=[h(1), h(2), h(3), h(4)], snapshot=True)
        while context.is_active():
            time.sleep(0.05)


def test_the_subscriber_resyncs_on_a_gap():
    servicer = GappyWorker()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    view, stop, counts = KvView(), threading.Event(), []
    done = threading.Event()
    try:
        KvSubscriber("w", pb_grpc.WorkerStub(channel), view, threading.Lock(), done.is_set, stop, counts.append).start()
        wait_for(lambda: view.seq == 4, 10, "the snapshot after the gap")
        assert view.hashes == {h(1), h(2), h(3), h(4)}
        assert servicer.requests == [(0, ""), (0, "")]  # the second asked for a snapshot, not to resume at 2
        assert counts == ["snapshot", "batch", "gap", "snapshot"]
    finally:
        done.set()
        stop.set()
        channel.close()
        server.stop(0)


# -- a real router following a real worker ------------------------------------------------------


def worker_cache(worker: Worker) -> set[bytes]:
    return worker.loop.call(lambda engine: set(engine.cached_block_hashes()), 10)


def router_view(router: Router, worker_id: str) -> set[bytes] | None:
    handles = [h for h in router.registry.live() if h.worker_id == worker_id]
    return set(handles[0].cached) if handles else None


def view_matches(router: Router, worker: Worker) -> bool:
    return router_view(router, worker.config.id) == worker_cache(worker)


def kv_events_counted(router: Router, kind: str) -> float:
    labels = dict(zip(("model_name", "role", "worker"), router.metrics.base), kind=kind)
    return router.metrics.registry.get_sample_value("pdserve:router_kv_events_total", labels) or 0.0


def test_the_routers_view_follows_the_worker_through_evictions_and_a_restart(one_thread):
    router = Router(RouterConfig(port=0, worker_timeout=5.0, stats_interval=60.0))  # no Stats poll in between
    address = router.start()
    config = WorkerConfig(role="mixed", router=router.internal_address, worker_id="mixed-kv", num_blocks=24)
    worker = Worker(config)
    try:
        worker.start()
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(40, 90))] for _ in range(8)]
        with Client(address, timeout=60) as client:
            for prompt in prompts[:2]:
                collect(client.generate(prompt, max_tokens=4, temperature=0.0))
                wait_for(lambda: view_matches(router, worker), 10, "the router's view to match the worker's cache")
            first = set(router_view(router, "mixed-kv"))
            assert first  # two prompts of 2-5 full blocks each are cached
            for prompt in prompts[2:]:  # 24 blocks hold about four: the first ones are evicted
                collect(client.generate(prompt, max_tokens=4, temperature=0.0))
            wait_for(lambda: view_matches(router, worker), 10, "the router's view to drop evicted blocks")
            assert not first <= router_view(router, "mixed-kv")  # evictions reached the router
            assert kv_events_counted(router, "batch") >= 3 and kv_events_counted(router, "gap") == 0
            snapshots = kv_events_counted(router, "snapshot")
            # A restart on the same port: a new process's cache (an empty one), a new epoch.
            port = int(worker.address.rsplit(":", 1)[1])
            worker.stop()
            worker = Worker(WorkerConfig(**{**config.__dict__, "port": port}))
            worker.start()
            wait_for(lambda: kv_events_counted(router, "snapshot") > snapshots, 10, "the restarted worker's snapshot")
            assert router_view(router, "mixed-kv") == set() == worker_cache(worker)  # the old cache is forgotten
            collect(client.generate(prompts[0], max_tokens=4, temperature=0.0))
            wait_for(lambda: view_matches(router, worker), 10, "the router's view of the restarted worker")
            assert router_view(router, "mixed-kv")
            (handle,) = router.registry.live()
            assert handle.kv.epoch == worker.engine.kv_events.epoch and handle.kv.seq == worker.engine.kv_events.seq
    finally:
        worker.stop()
        router.stop()

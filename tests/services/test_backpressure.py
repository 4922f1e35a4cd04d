"""Backpressure (issue 13): a client that stops reading is cut off and its blocks are
freed on every worker; the router's admission queue is bounded and refuses with a
retry hint. Real gRPC servers in this process (a router and one mixed worker, one
cluster for the module); the admission queue and the event queue also alone."""

from __future__ import annotations

import threading

import grpc
import pytest

from cluster_helpers import all_blocks_free, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.admission import Admission
from pdserve.services.router.client import Client, options_from_kwargs
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import FailedEvent, Failure, TokenEvent
from pdserve.services.node import Worker

pytestmark = pytest.mark.cluster(seconds=5)

WRITE_TIMEOUT = 1.0
# A client that keeps HTTP/2 flow control tight (no window growth): once it stops
# reading, the server's writes block after about 64 KiB.
TIGHT = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
# ~300 bytes a message (20 top logprobs each), ~1000 messages: far past any window.
FLOOD = dict(max_tokens=1000, temperature=0.0, ignore_eos=True, logprobs=20)


@pytest.fixture(scope="module")
def cluster():
    router = Router(RouterConfig(port=0, max_concurrent_requests=1, max_queued_requests=1, max_queue_wait=60.0,
                                 stream_write_timeout=WRITE_TIMEOUT))
    address = router.start()
    worker = Worker(WorkerConfig(role="mixed", router=router.internal_address, worker_id="mixed-0", num_blocks=256,
                                 stream_write_timeout=WRITE_TIMEOUT, metrics=False))
    worker.start()
    wait_for(lambda: router.registry.live(), 30, "the worker to register")
    yield router, worker, address
    worker.stop()
    router.stop()


def cutoffs(registry) -> float:
    """pdserve:stream_write_cutoffs_total, as /metrics would show it."""
    return sum(sample.value for metric in registry.collect() for sample in metric.samples
               if sample.name == "pdserve:stream_write_cutoffs_total")


def generate(address: str, options: list | None = None, **sampling) -> tuple[grpc.Channel, grpc.Call]:
    channel = grpc.insecure_channel(address, options=options or [])
    request = pb.GenerateRequest(text="def fib(n):", sampling=options_from_kwargs(**sampling))
    return channel, pb_grpc.GenerationStub(channel).Generate(request, timeout=120)


def test_a_client_that_stops_reading_is_cut_off_and_frees_its_blocks(cluster):
    router, worker, address = cluster
    channel, call = generate(address, TIGHT, **FLOOD)
    try:
        first = next(call)  # the request runs; from now on this client reads nothing
        assert first.token_ids
        wait_for(lambda: router.generation.write_guard.cut >= 1, 120, "the router to cut the stalled client off")
        assert cutoffs(router.metrics.registry) >= 1
        wait_for(lambda: all_blocks_free(worker.address), 60, "the worker to free the request's blocks")
        received = 1
        with pytest.raises(grpc.RpcError) as info:
            for message in call:  # what was already in flight, then the cut
                received += 1
                assert not message.finish_reason, "the stalled request ran to its end"
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert received < FLOOD["max_tokens"]
    finally:
        channel.close()
    # The cluster serves on: the slot was given back.
    with Client(address, timeout=60) as client:
        assert [m for m in client.generate("x = ", max_tokens=3, temperature=0.0)][-1].finish_reason == "length"


def test_a_decode_reader_that_stops_reading_is_cut_off_by_the_worker(cluster):
    """The worker guards its own streams: a reader of Decode (a router stuck behind
    its client, or gone quiet) that stops reading is cut off, the request freed."""
    router, worker, address = cluster
    channel = grpc.insecure_channel(worker.address, options=TIGHT)
    try:
        call = pb_grpc.WorkerStub(channel).Decode(pb.DecodeRequest(
            request_id="stalled-reader", local_prefill=True, token_ids=[5, 6, 7, 8],
            sampling=options_from_kwargs(**FLOOD)), timeout=120)
        assert next(call).deltas
        wait_for(lambda: worker.decode.write_guard.cut >= 1, 120, "the worker to cut the stalled reader off")
        wait_for(lambda: all_blocks_free(worker.address), 60, "the worker to free the request's blocks")
        with pytest.raises(grpc.RpcError) as info:
            for message in call:
                assert not message.finished, "the stalled request ran to its end"
        assert info.value.code() == grpc.StatusCode.CANCELLED
    finally:
        channel.close()


def test_a_full_admission_queue_refuses_with_a_retry_hint(cluster):
    router, worker, address = cluster
    admission = router.front_end.admission
    holder_channel, holder = generate(address, max_tokens=1000, temperature=0.0, ignore_eos=True)
    waiter_channel = refused_channel = None
    try:
        next(holder)  # holds the one slot
        waiter_channel, waiter = generate(address, max_tokens=2, temperature=0.0)
        outcome: dict = {}
        reader = threading.Thread(target=lambda: outcome.setdefault("messages", list(waiter)), daemon=True)
        reader.start()
        wait_for(lambda: admission.queued == 1, 30, "the second call to wait in the queue")
        refused_channel, refused = generate(address, max_tokens=2, temperature=0.0)
        with pytest.raises(grpc.RpcError) as info:
            list(refused)
        error = info.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests" in error.details()
        trailers = dict(error.trailing_metadata())
        assert int(trailers["retry-after-ms"]) > 0
        assert trailers["grpc-retry-pushback-ms"] == trailers["retry-after-ms"]
        holder.cancel()  # the slot goes to the waiting call, which then runs to its end
        reader.join(60)
        assert outcome["messages"][-1].finish_reason == "length"
    finally:
        for channel in (holder_channel, waiter_channel, refused_channel):
            if channel is not None:
                channel.close()
    wait_for(lambda: all_blocks_free(worker.address), 30, "every block to be free")


def test_admission_is_first_come_first_served_and_bounded():
    admission = Admission(slots=1, max_queued=2, max_wait=60.0)
    assert admission.acquire(1.0)
    order: list[str] = []
    threads = []
    for name in ("a", "b"):
        t = threading.Thread(target=lambda n=name: admission.acquire(60.0) and order.append(n), daemon=True)
        t.start()
        threads.append(t)
        wait_for(lambda: admission.queued == len(threads), 10, f"{name} to queue")
    assert not admission.acquire(60.0)  # the line is full: refused at once
    admission.release()
    wait_for(lambda: order == ["a"], 10, "a to get the slot first")
    admission.release()
    wait_for(lambda: order == ["a", "b"], 10, "b next")
    for t in threads:
        t.join(10)
    short = Admission(slots=1, max_queued=1, max_wait=0.05)
    assert short.acquire(1.0)
    assert not short.acquire(1.0)  # waited its max_wait, no slot came
    assert short.queued == 0
    short.release()
    assert short.acquire(0.0)


def test_a_reader_too_far_behind_ends_its_request_and_frees_its_blocks():
    """The event queue between the engine thread and a request's reader is bounded:
    a reader that takes nothing (its handler is stuck in a write) costs at most
    `max_stream_batches` steps of events, then its request ends."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=48)))
    loop = EngineLoop(engine, idle_wait=0.05, max_stream_batches=4).start()
    try:
        stream = loop.submit("stalled", list(range(3, 40)), SamplingParams(max_tokens=200, temperature=0.0,
                                                                            ignore_eos=True), timeout=10)
        wait_for(lambda: loop.stats(5).num_requests_running == 0, 60, "the request to end")
        events = stream.get(1.0)
        assert loop.stats(5).num_free_blocks == 48
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert len(tokens) <= 4 and isinstance(events[-1], FailedEvent)
        assert events[-1].failure == Failure.ABORTED and "stopped reading" in events[-1].message
    finally:
        loop.close()


def test_a_slow_producer_is_never_cut_off(cluster):
    """The write deadline times writes, not requests: a stream whose messages are
    far apart (a long prompt's prefill, here several requests queued in the engine)
    but read at once runs to its end."""
    router, worker, address = cluster
    with Client(address, timeout=120) as client:
        before = router.generation.write_guard.cut
        messages = list(client.generate("def f(x):", max_tokens=40, temperature=0.0, ignore_eos=True))
        assert messages[-1].finish_reason == "length"
        assert router.generation.write_guard.cut == before

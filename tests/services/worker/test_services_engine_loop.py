"""The engine thread: commands in, per-request events out, every path frees blocks.
Deadlines run on a ManualClock: a test moves time on instead of waiting for it."""

from __future__ import annotations

import resource
import threading
import time

import pytest

from cluster_helpers import wait_for
from engine_helpers import drain, one_thread  # noqa: F401 (one_thread: an autouse fixture)
from manual_clock import ManualClock
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine, NoCapacityError
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.kvtransfer.connector import KVConnector, Transport
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transports.zmq import ZmqReceiver
from pdserve.kvtransfer.wire import PagesHeader, sign
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import FailedEvent, Failure, FinishedEvent, RequestStream, TokenEvent
from pdserve.services.worker.requests import State

NUM_BLOCKS = 48
PROMPT = list(range(3, 40))
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
LONG = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)


LEASE = 30.0  # held blocks' lease and unclaimed streams' ttl: passed by moving the clock


def new_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=NUM_BLOCKS)))


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def loop(clock):
    loop = EngineLoop(new_engine(), clock=clock, idle_wait=0.05, held_lease=LEASE, unclaimed_ttl=LEASE).start()
    yield loop
    loop.close()


def first_token(stream: RequestStream) -> TokenEvent:
    give_up = time.monotonic() + 30
    while True:
        assert time.monotonic() < give_up
        events = stream.get(0.5)
        if events:
            assert isinstance(events[0], TokenEvent)
            return events[0]


def all_free(loop: EngineLoop) -> bool:
    stats = loop.stats(5)
    loop.call(lambda e: e.check_integrity(), 5)
    return stats.num_free_blocks == NUM_BLOCKS and not any(
        (stats.num_requests_running, stats.num_requests_waiting, stats.num_requests_held, stats.num_requests_reserved)
    )


def test_tokens_then_the_finished_output(loop):
    events = drain(loop.submit("a", PROMPT, GREEDY, timeout=5))
    *tokens, finished = events
    assert isinstance(finished, FinishedEvent) and all(isinstance(t, TokenEvent) for t in tokens)
    assert [t.delta.token_id for t in tokens] == finished.output.outputs[0].token_ids
    assert tokens[-1].delta.finish_reason == "length"
    assert all_free(loop)


def test_bad_input_fails_only_that_request(loop):
    running = loop.submit("ok", PROMPT, LONG, timeout=5)
    first_token(running)
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit("too-long", PROMPT, SamplingParams(max_tokens=2000), timeout=5)
    with pytest.raises(ValueError, match="request_id"):
        loop.submit("ok", PROMPT, GREEDY, timeout=5)
    loop.abort("ok")
    assert isinstance(drain(running)[-1], FailedEvent)


def test_abort_mid_run_frees_the_blocks(loop):
    stream = loop.submit("a", PROMPT, LONG, timeout=5)
    first_token(stream)
    loop.abort("a")
    loop.abort("a")  # idempotent
    end = drain(stream)[-1]
    assert isinstance(end, FailedEvent) and end.failure is Failure.ABORTED
    assert all_free(loop)


def test_reservation_streams_after_commit_and_expires_without(loop, clock):
    reservation, plan = loop.reserve("r", PROMPT, GREEDY, lease=5.0, timeout=5)
    assert len(reservation.block_ids) == 3 and loop.stats(5).num_requests_reserved == 1
    assert plan == b""  # no KV connector: no plan; whoever fills the blocks commits
    stream = loop.attach("r", timeout=5)
    with pytest.raises(KeyError, match="request_id"):
        loop.attach("r", timeout=5)
    loop.commit_remote("r", first_token=7)
    *tokens, finished = drain(stream)
    assert tokens[0].delta.token_id == 7 and isinstance(finished, FinishedEvent)
    assert finished.output.outputs[0].token_ids[0] == 7

    loop.reserve("late", PROMPT, GREEDY, lease=5.0, timeout=5)
    stream = loop.attach("late", timeout=5)
    clock.advance(4.9)
    loop.wake()
    loop.call(lambda e: None, 5)
    assert loop.stats(5).num_requests_reserved == 1  # not yet
    clock.advance(0.1)
    end = drain(stream, timeout=5)[-1]
    assert isinstance(end, FailedEvent) and end.failure is Failure.EXPIRED
    loop.commit_remote("late", first_token=7)  # too late: ignored
    assert all_free(loop)


def test_abandoning_a_reservation_fails_it_only_while_its_kv_is_awaited(loop):
    """The router abandons a reservation whose prefill worker died (Abort with
    only_reserved): still waiting, it fails as a lost transfer (the router falls back);
    already committed and decoding, it goes on untouched."""
    loop.reserve("waiting", PROMPT, GREEDY, lease=30.0, timeout=5)
    stream = loop.attach("waiting", timeout=5)
    loop.abandon_reservation("waiting")
    end = drain(stream, timeout=5)[-1]
    assert isinstance(end, FailedEvent) and end.failure is Failure.TRANSFER

    loop.reserve("decoding", PROMPT, LONG, lease=30.0, timeout=5)
    stream = loop.attach("decoding", timeout=5)
    loop.commit_remote("decoding", first_token=7)
    first_token(stream)
    loop.abandon_reservation("decoding")  # too late to matter: its KV is here
    *tokens, finished = drain(stream, timeout=60)
    assert isinstance(finished, FinishedEvent) and len(finished.output.outputs[0].token_ids) == LONG.max_tokens
    assert all_free(loop)


def test_a_reservation_that_ends_before_its_stream_is_attached_still_streams(loop):
    """Under load the router's Decode call can reach the worker after the KV was
    committed and the request finished (or failed): the stream, every event in it,
    waits for that one attach (found by tests/cluster/test_load.py as NOT_FOUND)."""
    loop.reserve("quick", PROMPT, SamplingParams(max_tokens=2, temperature=0.0), lease=5.0, timeout=5)
    loop.commit_remote("quick", first_token=7)
    wait_for(lambda: loop.stats(5).num_free_blocks == NUM_BLOCKS, 10, "the finished request's blocks",
             step=0.01)
    *tokens, finished = drain(loop.attach("quick", timeout=5))
    assert [t.delta.token_id for t in tokens][0] == 7 and isinstance(finished, FinishedEvent)
    assert finished.output.outputs[0].token_ids == [t.delta.token_id for t in tokens]
    with pytest.raises(KeyError, match="request_id"):
        loop.attach("quick", timeout=5)  # once

    loop.reserve("gone", PROMPT, GREEDY, lease=5.0, timeout=5)
    loop.abort("gone")
    end = drain(loop.attach("gone", timeout=5))[-1]
    assert isinstance(end, FailedEvent) and end.failure is Failure.ABORTED
    assert all_free(loop)


def test_an_unattached_ended_stream_is_dropped_after_a_while(loop, clock):
    loop.reserve("never", PROMPT, GREEDY, lease=5.0, timeout=5)
    loop.abort("never")
    loop.call(lambda e: None, 5)  # the abort (queued) has run: its ttl counts from now
    clock.advance(LEASE)
    wait_for(lambda: loop.call(lambda e: loop.requests.get("never") is None, 5), 10, "the unclaimed stream to go")
    with pytest.raises(KeyError, match="request_id"):
        loop.attach("never", timeout=5)
    loop.reserve("late", PROMPT, GREEDY, lease=5.0, timeout=5)
    loop.abort("late")
    loop.call(lambda e: None, 5)
    clock.advance(LEASE - 0.1)
    loop.wake()
    loop.call(lambda e: None, 5)
    assert isinstance(drain(loop.attach("late", timeout=5))[-1], FailedEvent)  # within its ttl: still there
    assert all_free(loop)


def test_reservation_without_room_raises(loop):
    with pytest.raises(NoCapacityError):
        loop.reserve("huge", [5] * (16 * NUM_BLOCKS + 10), SamplingParams(max_tokens=1), lease=5, timeout=5)
    assert all_free(loop)


def test_exported_blocks_are_held_until_release_or_lease(loop, clock):
    drain(loop.submit("p", PROMPT, SamplingParams(max_tokens=1), timeout=5, export_kv=True))
    assert loop.stats(5).num_requests_held == 1
    assert loop.call(lambda e: len(e.held_block_ids("p")), 5) == 3
    loop.release("p")
    assert all_free(loop)
    drain(loop.submit("q", PROMPT, SamplingParams(max_tokens=1), timeout=5, export_kv=True))
    clock.advance(LEASE - 0.1)
    loop.wake()
    loop.call(lambda e: None, 5)
    assert loop.stats(5).num_requests_held == 1  # the lease has not run out yet
    clock.advance(0.1)  # now it has
    wait_for(lambda: all_free(loop), 10, "the held blocks to be released")


def test_an_engine_error_fails_the_requests_in_flight_and_the_loop_goes_on(loop, monkeypatch):
    stream = loop.submit("victim", PROMPT, LONG, timeout=5)
    first_token(stream)
    real_step = loop.engine.step

    def broken() -> list:
        monkeypatch.setattr(loop.engine, "step", real_step)
        raise RuntimeError("injected")

    monkeypatch.setattr(loop.engine, "step", broken)
    end = drain(stream)[-1]
    assert isinstance(end, FailedEvent) and end.failure is Failure.INTERNAL and "injected" in end.message
    assert isinstance(drain(loop.submit("next", PROMPT, GREEDY, timeout=5))[-1], FinishedEvent)
    assert all_free(loop)


def test_idle_loop_does_not_spin(loop):
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 0.2


def test_close_fails_open_requests(loop):
    stream = loop.submit("open", PROMPT, LONG, timeout=5)
    first_token(stream)
    loop.close()
    end = drain(stream)[-1]
    assert isinstance(end, FailedEvent) and end.failure is Failure.SHUTDOWN
    with pytest.raises(RuntimeError, match="not running"):
        loop.stats(1)


def test_pollers_run_on_the_engine_thread_and_may_fail(loop):
    threads: set[str] = set()
    loop.add_poller(lambda: threads.add(threading.current_thread().name))
    loop.add_poller(lambda: 1 / 0)  # logged, the loop goes on
    wait_for(lambda: threads, 10, "the poller to run", step=0.01)
    assert threads == {"engine-loop"}
    assert isinstance(drain(loop.submit("after", PROMPT, GREEDY, timeout=5))[-1], FinishedEvent)


def test_snapshot_answers_without_the_engine_thread(loop, clock):
    stream = loop.submit("busy", PROMPT, LONG, timeout=5)
    first_token(stream)
    snap = loop.snapshot()
    assert snap.num_requests_running == 1 and snap.at == clock()
    now = clock.advance(10.0)
    wait_for(lambda: loop.snapshot().at == now, 10, "a fresh snapshot", step=0.01)  # kept fresh unasked
    loop.abort("busy")
    drain(stream)
    wait_for(lambda: loop.snapshot().num_free_blocks == NUM_BLOCKS, 5, "the snapshot to see the blocks free",
             step=0.05)


def test_a_cancel_while_pages_land_keeps_the_blocks_until_the_write_is_over():
    """A KV receiver that cannot stop a write at once says so: the stream ends now,
    the blocks stay until the write is over, then the request table frees them (the
    receiver's news wakes the loop). The write is held open by the test, as the
    receiver's thread would while a message's bytes land."""
    engine = new_engine()
    kv = engine.runner.kv_cache
    receiver = ZmqReceiver(kv, "tcp://127.0.0.1:0")
    connector = KVConnector(Transport(receiver=receiver), kv, engine.model_config.vocab_size)
    loop = EngineLoop(engine, connector=connector, idle_wait=600.0).start()  # it looks only when woken
    try:
        _, raw = loop.reserve("busy", PROMPT, GREEDY, lease=30.0, timeout=5)
        plan = TransferPlan.unpack(raw)
        stream = loop.attach("busy", timeout=5)
        layout = plan.layout
        header = sign(PagesHeader("busy", 0, 0, ((plan.skip_blocks, 1),), (layout.page_bytes,), layout.dtype,
                                  layout.wire_page), plan.secret)
        state = lambda: loop.call(lambda e: loop.requests.get("busy").state, 5)  # noqa: E731
        with receiver.inbox.pages(header, b"the sender") as landings:
            loop.wake()
            wait_for(lambda: state() is State.RECEIVING, 10, "the reservation to be receiving", step=0.01)
            loop.abort("busy")
            end = drain(stream, timeout=5)[-1]
            assert isinstance(end, FailedEvent) and end.failure is Failure.ABORTED
            stats = loop.stats(5)
            assert stats.num_requests_reserved == 0 and stats.num_free_blocks == NUM_BLOCKS - 3  # kept
            assert state() is State.FAILED
            landings[0].buffer()[:] = bytes(landings[0].nbytes)
        wait_for(lambda: loop.stats(5).num_free_blocks == NUM_BLOCKS, 10, "the blocks to be freed", step=0.01)
        assert loop.call(lambda e: loop.requests.get("busy"), 5) is None and all_free(loop)
    finally:
        loop.close()


def test_commits_on_the_engine_thread_take_effect_at_once_and_wake_runs_the_pollers():
    polled: list[int] = []
    loop = EngineLoop(new_engine(), idle_wait=600.0)  # no turn but for commands and wake-ups
    loop.add_poller(lambda: polled.append(1))
    loop.start()
    try:
        assert not polled  # idle from the start: waiting for a command
        loop.wake()
        wait_for(lambda: polled, 10, "the woken loop to run its pollers", step=0.01)
        loop.reserve("now", PROMPT, GREEDY, lease=30.0, timeout=5)
        stream = loop.attach("now", timeout=5)
        seen: list[int] = []
        loop.call(lambda e: (loop.commit_remote("now", 7), seen.append(len(e.scheduler.running))), 5)
        assert seen == [1]
        assert isinstance(drain(stream)[-1], FinishedEvent)
    finally:
        loop.close()

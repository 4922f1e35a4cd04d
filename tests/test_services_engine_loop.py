"""The engine thread: commands in, per-request events out, every path frees blocks."""

from __future__ import annotations

import resource
import time

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine, NoCapacityError
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import FailedEvent, Failure, FinishedEvent, RequestStream, TokenEvent

NUM_BLOCKS = 48
PROMPT = list(range(3, 40))
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
LONG = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def loop():
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    loop = EngineLoop(engine, idle_wait=0.05, held_lease=0.3).start()
    yield loop
    loop.close()


def drain(stream: RequestStream, timeout: float = 30.0) -> list:
    """Events until the request ends."""
    events: list = []
    give_up = time.monotonic() + timeout
    while not events or isinstance(events[-1], TokenEvent):
        assert time.monotonic() < give_up, f"no end of {stream.request_id} within {timeout}s"
        events += stream.get(0.5)
    return events


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


def test_reservation_streams_after_commit_and_expires_without(loop):
    reservation = loop.reserve("r", PROMPT, GREEDY, lease=5.0, timeout=5)
    assert len(reservation.block_ids) == 3 and loop.stats(5).num_requests_reserved == 1
    stream = loop.attach("r", timeout=5)
    with pytest.raises(KeyError, match="request_id"):
        loop.attach("r", timeout=5)
    loop.commit_remote("r", first_token=7)
    *tokens, finished = drain(stream)
    assert tokens[0].delta.token_id == 7 and isinstance(finished, FinishedEvent)
    assert finished.output.outputs[0].token_ids[0] == 7

    loop.reserve("late", PROMPT, GREEDY, lease=0.3, timeout=5)
    end = drain(loop.attach("late", timeout=5), timeout=5)[-1]
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
    waits for that one attach (found by tests/test_load.py as NOT_FOUND)."""
    loop.reserve("quick", PROMPT, SamplingParams(max_tokens=2, temperature=0.0), lease=5.0, timeout=5)
    loop.commit_remote("quick", first_token=7)
    wait_for_free = time.monotonic() + 10
    while loop.stats(5).num_free_blocks != NUM_BLOCKS:  # finished: its blocks are back
        assert time.monotonic() < wait_for_free
        time.sleep(0.01)
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


def test_an_unattached_ended_stream_is_dropped_after_a_while():
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    loop = EngineLoop(engine, idle_wait=0.05, unclaimed_ttl=0.2).start()
    try:
        loop.reserve("never", PROMPT, GREEDY, lease=5.0, timeout=5)
        loop.abort("never")
        time.sleep(0.5)
        with pytest.raises(KeyError, match="request_id"):
            loop.attach("never", timeout=5)
    finally:
        loop.close()


def test_reservation_without_room_raises(loop):
    with pytest.raises(NoCapacityError):
        loop.reserve("huge", [5] * (16 * NUM_BLOCKS + 10), SamplingParams(max_tokens=1), lease=5, timeout=5)
    assert all_free(loop)


def test_exported_blocks_are_held_until_release_or_lease(loop):
    drain(loop.submit("p", PROMPT, SamplingParams(max_tokens=1), timeout=5, export_kv=True))
    assert loop.stats(5).num_requests_held == 1
    assert loop.call(lambda e: len(e.held_block_ids("p")), 5) == 3
    loop.release("p")
    assert all_free(loop)
    drain(loop.submit("q", PROMPT, SamplingParams(max_tokens=1), timeout=5, export_kv=True))
    time.sleep(0.6)  # the lease (0.3 s) runs out
    assert all_free(loop)


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
    import threading

    threads: set[str] = set()
    loop.add_poller(lambda: threads.add(threading.current_thread().name))
    loop.add_poller(lambda: 1 / 0)  # logged, the loop goes on
    time.sleep(0.3)
    assert threads == {"engine-loop"}
    assert isinstance(drain(loop.submit("after", PROMPT, GREEDY, timeout=5))[-1], FinishedEvent)


def test_snapshot_answers_without_the_engine_thread(loop):
    stream = loop.submit("busy", PROMPT, LONG, timeout=5)
    first_token(stream)
    snap = loop.snapshot()
    assert snap.num_requests_running == 1 and time.monotonic() - snap.at < 5
    loop.abort("busy")
    drain(stream)
    give_up = time.monotonic() + 5
    while loop.snapshot().num_free_blocks != NUM_BLOCKS:
        assert time.monotonic() < give_up
        time.sleep(0.05)


def test_an_abort_hook_may_keep_blocks_a_write_is_still_landing_in():
    """A KV receiver that cannot stop a write at once says so (False): the stream ends
    now, the blocks stay until the receiver frees them; commits and failures told from
    the engine thread take effect at once, and `wake` runs the pollers."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    loop = EngineLoop(engine, idle_wait=5.0)
    landing: set[str] = {"busy"}
    polled: list[float] = []
    loop.add_abort_hook(lambda rid: rid not in landing)
    loop.add_poller(lambda: polled.append(time.monotonic()))
    loop.start()
    try:
        loop.reserve("busy", PROMPT, GREEDY, lease=30.0, timeout=5)
        stream = loop.attach("busy", timeout=5)
        loop.abort("busy")
        end = drain(stream, timeout=5)[-1]
        assert isinstance(end, FailedEvent) and end.failure is Failure.ABORTED
        stats = loop.stats(5)
        assert stats.num_requests_reserved == 0 and stats.num_free_blocks == NUM_BLOCKS - 3  # kept
        loop.call(lambda e: e.abort("busy"), 5)  # the write is over: the receiver frees them
        assert loop.stats(5).num_free_blocks == NUM_BLOCKS

        # On the engine thread, commit_remote happens before the poller returns.
        loop.reserve("now", PROMPT, GREEDY, lease=30.0, timeout=5)
        stream = loop.attach("now", timeout=5)
        seen: list[int] = []
        loop.call(lambda e: (loop.commit_remote("now", 7), seen.append(len(e.scheduler.running))), 5)
        assert seen == [1]
        assert isinstance(drain(stream)[-1], FinishedEvent)
        polled.clear()
        started = time.monotonic()
        loop.wake()  # idle_wait is 5 s: only the wake-up runs the poller this soon
        give_up = started + 2.0
        while not polled and time.monotonic() < give_up:
            time.sleep(0.01)
        assert polled and polled[0] - started < 1.0
    finally:
        loop.close()

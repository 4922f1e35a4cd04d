"""A request that makes the engine step fail fails alone (issue 13), seen from the
engine thread's streams: the model raises whenever its batch holds a poisoned token
(a device fault only some inputs trigger; the seam is a wrapper around the real
model, nothing of the engine or the loop is replaced). The other requests stream
exactly the tokens of their solo runs, and every block is free at the end."""

from __future__ import annotations

import logging

from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import FailedEvent, Failure, FinishedEvent
from engine_helpers import POISON, Poisoned, drain, one_thread  # noqa: F401 (one_thread: an autouse fixture)

NUM_BLOCKS = 64
PROMPTS = {"greedy": [5, 6, 7, 8, 9, 10, 11, 12], "sampled": list(range(20, 60)), "pair": [40, 41, 42]}
PARAMS = {
    "greedy": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True),
    "pair": SamplingParams(max_tokens=16, temperature=0.9, seed=3, n=2, ignore_eos=True),
}


def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=NUM_BLOCKS)))


def solo_runs() -> dict[str, dict[int, list[int]]]:
    """Each request's tokens per sequence, run alone (one after another) on a clean engine."""
    loop = EngineLoop(engine(), idle_wait=0.05).start()
    out = {}
    try:
        for rid in PROMPTS:
            *_, end = drain(loop.submit(rid, PROMPTS[rid], PARAMS[rid], timeout=10))
            assert isinstance(end, FinishedEvent)
            out[rid] = {c.index: c.token_ids for c in end.output.outputs}
        return out
    finally:
        loop.close()


def test_a_request_that_breaks_the_step_fails_alone(caplog):
    expected = solo_runs()
    poisoned = engine()
    poisoned.runner.model = Poisoned(poisoned.runner.model, POISON)
    loop = EngineLoop(poisoned, idle_wait=0.05).start()
    try:
        streams = {rid: loop.submit(rid, PROMPTS[rid], PARAMS[rid], timeout=10) for rid in PROMPTS}
        firsts = {rid: s.get(30) for rid, s in streams.items()}  # all of them are running now
        assert all(firsts.values())
        with caplog.at_level(logging.ERROR, logger="pdserve.engine.core"):
            bad = drain(loop.submit("bad", [5, POISON, 7, 8], SamplingParams(max_tokens=16, temperature=0.0), 10))
            ends = {rid: firsts[rid] + drain(s) for rid, s in streams.items()}
        assert isinstance(bad[-1], FailedEvent) and bad[-1].failure == Failure.INTERNAL
        assert "device fault" in bad[-1].message
        assert any("bad" in r.getMessage() for r in caplog.records), "the failure is logged with its request id"
        for rid, events in ends.items():
            assert isinstance(events[-1], FinishedEvent), (rid, events[-1])
            streamed: dict[int, list[int]] = {}
            for e in events[:-1]:
                streamed.setdefault(e.delta.index, []).append(e.delta.token_id)
            assert streamed == expected[rid], rid
        stats = loop.stats(5)
        assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests_running == 0
        loop.call(lambda e: e.check_integrity(), 5)
    finally:
        loop.close()


def test_a_request_that_can_never_fit_fails_alone_as_no_room():
    """Beams the whole pool cannot hold: that request ends with NO_ROOM (the decode
    worker answers RESOURCE_EXHAUSTED, and the router may try another worker), while
    a small request beside it finishes."""
    small = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=6, block_size=16)))
    loop = EngineLoop(small, idle_wait=0.05).start()
    try:
        huge = loop.submit("huge", [5] * 40, SamplingParams(max_tokens=60, beam_width=4, n=2, ignore_eos=True), 10)
        fine = loop.submit("fine", [6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0), 10)
        end = drain(huge)[-1]
        assert isinstance(end, FailedEvent) and end.failure == Failure.NO_ROOM, end
        assert isinstance(drain(fine)[-1], FinishedEvent)
        assert loop.stats(5).num_free_blocks == 6
    finally:
        loop.close()


class FailingOnce:
    """The engine's scheduler, whose next `schedule()` raises (a bug outside the
    engine's per-request isolation); every other call goes to the real one."""

    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler
        self.armed = False

    def schedule(self):
        if self.armed:
            self.armed = False
            raise RuntimeError("scheduler bug")
        return self._scheduler.schedule()

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


def test_a_step_failing_outside_the_engine_spares_reservations_and_the_engine_goes_on(caplog):
    eng = engine()
    failing = FailingOnce(eng.core.scheduler)
    eng.core.scheduler = failing
    loop = EngineLoop(eng, idle_wait=0.05).start()
    try:
        loop.reserve("waiting-for-kv", PROMPTS["greedy"], PARAMS["greedy"], lease=60.0, timeout=10)
        running = loop.submit("running", PROMPTS["sampled"], PARAMS["sampled"], timeout=10)
        first = running.get(30)
        assert first
        with caplog.at_level(logging.ERROR, logger="pdserve.services.worker.requests"):
            loop.call(lambda e: setattr(failing, "armed", True), 5)
            end = drain(running)[-1]
        assert isinstance(end, FailedEvent) and end.failure == Failure.INTERNAL and "scheduler bug" in end.message
        assert any("running" in r.getMessage() for r in caplog.records)
        assert loop.stats(5).num_requests_reserved == 1  # the reservation was in no batch: kept
        after = drain(loop.submit("after", PROMPTS["pair"], PARAMS["pair"], timeout=10))[-1]
        assert isinstance(after, FinishedEvent)  # the engine is consistent and serves on
        loop.abort("waiting-for-kv")
        free = loop.call(lambda e: e.check_integrity() or e.stats().num_free_blocks, 5)
        assert free == NUM_BLOCKS
    finally:
        loop.close()

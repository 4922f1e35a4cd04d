"""One record per request (services/worker/requests.py), driven through every move
of its state machine on real engines, with the real ZeroMQ connector where KV
crosses, stepped by hand (no engine thread) on a ManualClock. After each path out,
every block is free (engine.check_integrity(), free blocks == total).

    QUEUED -> RUNNING -> FINISHED | HELD -> FINISHED | FAILED
    RESERVED -> RECEIVING -> QUEUED -> ...;  RESERVED | RECEIVING -> FAILED
"""

from __future__ import annotations

import logging
import re
import time

import pytest

from manual_clock import ManualClock
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.kvtransfer.connector import KVConnector, Transport
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transfer import Phase
from pdserve.kvtransfer.transports.zmq import ZmqReceiver, ZmqSender
from pdserve.kvtransfer.wire import PagesHeader, sign
from pdserve.services.worker.events import FailedEvent, Failure, FinishedEvent, RequestStream, TokenEvent
from pdserve.services.worker.requests import IllegalTransition, RequestTable, State
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)

NUM_BLOCKS = 48
PROMPT = list(range(3, 40))  # 37 tokens: 3 blocks of 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
LEASE = 30.0
WAIT_S = 60.0
MOVE = re.compile(r"request (\S+): (\w+) -> (\w+)")


@pytest.fixture
def clock():
    return ManualClock()


def table(clock: ManualClock, sender: bool = False, receiver: bool = False) -> RequestTable:
    """A worker's request table on a fresh engine, with a ZeroMQ sender and/or receiver."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    kv = engine.runner.kv_cache
    transport = Transport(ZmqSender() if sender else None, ZmqReceiver(kv, "tcp://127.0.0.1:0") if receiver else None)
    connector = KVConnector(transport, kv, engine.model_config.vocab_size, clock)
    connector.start()
    return RequestTable(engine, connector, clock=clock, held_lease=LEASE, unclaimed_ttl=LEASE)


@pytest.fixture
def plain(clock):
    t = table(clock)
    yield t
    t.connector.close()


@pytest.fixture
def decode(clock):
    t = table(clock, receiver=True)
    yield t
    t.connector.close()


@pytest.fixture
def prefill(clock):
    t = table(clock, sender=True)
    yield t
    t.connector.close()


def all_free(t: RequestTable) -> bool:
    t.engine.check_integrity()
    stats = t.engine.stats()
    return stats.num_free_blocks == stats.num_blocks == NUM_BLOCKS and not t.live()


def run_until(condition, *tables: RequestTable, what: str) -> None:
    give_up = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < give_up, f"{what}: not within {WAIT_S:.0f}s"
        for t in tables:
            t.advance()
        time.sleep(0.001)


def events(stream: RequestStream) -> list:
    return stream.get(0)


def local_tokens(prompt: list[int], params: SamplingParams) -> list[int]:
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    engine.add_request("local", prompt, params)
    while True:
        for output in engine.step():
            return output.outputs[0].token_ids


def landing(plan: TransferPlan) -> PagesHeader:
    """A signed pages header for the plan's first block it lacks (what its sender sends)."""
    layout = plan.layout
    header = PagesHeader(plan.request_id, 0, 0, ((plan.skip_blocks, 1),), (layout.page_bytes,), layout.dtype,
                         layout.wire_page)
    return sign(header, plan.secret)


# -- the paths a transfer takes -------------------------------------------------------------


def test_a_transfer_takes_both_records_through_their_states_and_frees_every_block(decode, prefill, caplog):
    """Each table's moves, from its debug log of every move (the tables share the
    request id, as a router gives both workers; each is stepped alone, so a move
    logged during its step is its own)."""
    caplog.set_level(logging.DEBUG, logger="pdserve.services.worker.requests")
    _, raw = decode.reserve("t", PROMPT, GREEDY, LEASE)
    stream = decode.attach("t")
    plan = TransferPlan.unpack(raw)
    assert plan.sample_first_token  # n == 1, no beams: the prefill worker's first token is used
    prefilled = prefill.submit("t", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), plan=plan)
    assert (decode.get("t").state, prefill.get("t").state) == (State.RESERVED, State.QUEUED)
    seen: dict[str, list[str]] = {"decode": [], "prefill": []}
    give_up = time.monotonic() + WAIT_S
    while decode.get("t") is not None or prefill.get("t") is not None:
        assert time.monotonic() < give_up, "the transfer did not end"
        for name, t in (("prefill", prefill), ("decode", decode)):
            before = len(caplog.records)
            t.advance()
            seen[name] += [m.group(3) for m in (MOVE.match(r.getMessage()) for r in caplog.records[before:]) if m]
        time.sleep(0.001)
    assert seen == {"prefill": ["RUNNING", "HELD", "FINISHED"], "decode": ["RECEIVING", "QUEUED", "RUNNING", "FINISHED"]}
    got = events(stream)
    tokens = [e.delta.token_id for e in got if isinstance(e, TokenEvent)]
    assert isinstance(got[-1], FinishedEvent) and tokens == local_tokens(PROMPT, GREEDY)
    first = events(prefilled)
    assert isinstance(first[-1], FinishedEvent) and first[-1].output.outputs[0].token_ids == tokens[:1]
    assert all_free(decode) and all_free(prefill)
    assert decode.connector.stats().kv_transfers == prefill.connector.stats().kv_transfers == 1


def test_parallel_samples_recompute_the_first_token_here(decode, prefill):
    params = SamplingParams(max_tokens=4, temperature=0.0, n=2, ignore_eos=True)
    _, raw = decode.reserve("n2", PROMPT, params, LEASE)
    stream = decode.attach("n2")
    plan = TransferPlan.unpack(raw)
    assert not plan.sample_first_token  # the one rule: n > 1 samples its first token on the decode worker
    prefilled = prefill.submit("n2", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), plan=plan)
    run_until(lambda: decode.get("n2") is None and prefill.get("n2") is None, prefill, decode, what="both to end")
    assert isinstance(events(prefilled)[-1], FinishedEvent)
    end = events(stream)[-1]
    assert isinstance(end, FinishedEvent) and [len(c.token_ids) for c in end.output.outputs] == [4, 4]
    assert all_free(decode) and all_free(prefill)


# -- ways out of a reservation ----------------------------------------------------------------


def test_cancel_while_receiving_keeps_the_blocks_until_the_write_is_over(decode):
    _, raw = decode.reserve("c", PROMPT, GREEDY, LEASE)
    stream = decode.attach("c")
    plan = TransferPlan.unpack(raw)
    receiver = decode.connector.transport.receiver
    with receiver.inbox.pages(landing(plan), b"the sender") as landings:  # as the receiver's thread would
        decode.advance()
        assert decode.get("c").state is State.RECEIVING
        decode.abort("c")
        record = decode.get("c")
        assert record.state is State.FAILED and record.transfer.phase is Phase.CANCELLING  # pages landing
        [end] = events(stream)
        assert isinstance(end, FailedEvent) and end.failure is Failure.ABORTED
        decode.advance()
        assert decode.engine.stats().num_free_blocks == NUM_BLOCKS - 3  # still landing: kept
        assert decode.get("c") is record
        landings[0].buffer()[:] = bytes(landings[0].nbytes)
    run_until(lambda: decode.get("c") is None, decode, what="the blocks to be freed once the write is over")
    assert all_free(decode)


def test_a_reservation_expires_at_its_deadline_reserved_or_receiving(decode, clock):
    decode.reserve("idle", PROMPT, GREEDY, 5.0)
    idle = decode.attach("idle")
    _, raw = decode.reserve("started", PROMPT[:20], GREEDY, 10.0)
    started = decode.attach("started")
    receiver = decode.connector.transport.receiver
    with receiver.inbox.pages(landing(TransferPlan.unpack(raw)), b"the sender") as landings:
        landings[0].buffer()[:] = bytes(landings[0].nbytes)
    decode.advance()
    assert (decode.get("idle").state, decode.get("started").state) == (State.RESERVED, State.RECEIVING)
    clock.advance(4.99)
    decode.advance()
    assert decode.get("idle").state is State.RESERVED  # not yet
    clock.advance(0.01)
    decode.advance()
    assert decode.get("idle") is None and decode.get("started").state is State.RECEIVING
    [end] = events(idle)
    assert end.failure is Failure.EXPIRED and "deadline" in end.message
    clock.advance(5.0)  # the RECEIVING record keeps the deadline it was reserved with
    decode.advance()
    [end] = events(started)
    assert end.failure is Failure.EXPIRED
    run_until(lambda: not decode.connector.decode.expecting(), decode, what="the receiver to drop both")
    assert all_free(decode)


def test_abandoning_fails_only_a_reservation_still_waiting(plain):
    plain.reserve("waiting", PROMPT, GREEDY, LEASE)
    waiting = plain.attach("waiting")
    plain.abandon("waiting")
    [end] = events(waiting)
    assert end.failure is Failure.TRANSFER
    plain.reserve("decoding", PROMPT, LONG, LEASE)
    decoding = plain.attach("decoding")
    plain.commit("decoding", 7)
    assert plain.get("decoding").state is State.QUEUED
    plain.advance()
    assert plain.get("decoding").state is State.RUNNING
    plain.abandon("decoding")  # its KV is here: it goes on
    assert plain.get("decoding").state is State.RUNNING
    plain.abort("decoding")
    assert events(decoding)[-1].failure is Failure.ABORTED
    assert all_free(plain)


def test_a_reservation_that_ends_unattached_keeps_its_stream_for_the_ttl(plain, clock):
    plain.reserve("early", PROMPT, GREEDY, LEASE)
    plain.abort("early")  # before its Decode call: the stream waits for that call
    assert plain.get("early").state is State.FAILED and plain.num_unattached == 0
    assert events(plain.attach("early"))[-1].failure is Failure.ABORTED
    with pytest.raises(KeyError, match="request_id"):
        plain.attach("early")  # once
    plain.reserve("late", PROMPT, GREEDY, LEASE)
    assert plain.num_unattached == 1
    plain.abort("late")
    clock.advance(LEASE)
    plain.advance()
    with pytest.raises(KeyError, match="request_id"):
        plain.attach("late")  # its ttl ran out
    assert all_free(plain)


# -- ways out of a request that runs here ------------------------------------------------------


def test_queued_running_held_and_their_ways_out(plain, clock):
    plain.submit("queued", PROMPT, LONG)
    plain.abort("queued")  # QUEUED -> FAILED, before any step
    running = plain.submit("running", PROMPT, LONG)
    plain.advance()
    assert plain.get("running").state is State.RUNNING
    plain.abort("running")
    assert events(running)[-1].failure is Failure.ABORTED
    done = plain.submit("done", PROMPT, GREEDY)
    run_until(lambda: plain.get("done") is None, plain, what="the request to finish")
    assert isinstance(events(done)[-1], FinishedEvent)
    # QUEUED -> FINISHED: a given first token that already ends it
    forced = plain.submit("forced", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), first_token=9)
    assert plain.get("forced") is None and isinstance(events(forced)[-1], FinishedEvent)
    # HELD: released (FINISHED), or its lease runs out (FAILED)
    for rid in ("released", "leased"):
        plain.submit(rid, PROMPT, SamplingParams(max_tokens=1), export_kv=True)
        run_until(lambda rid=rid: plain.get(rid).state is State.HELD, plain, what=f"{rid} to be held")
    plain.release("released")
    assert plain.get("released") is None
    clock.advance(LEASE - 0.01)
    plain.advance()
    assert plain.get("leased").state is State.HELD
    clock.advance(0.01)
    plain.advance()
    assert plain.get("leased") is None
    assert all_free(plain)


def test_moves_outside_the_state_machine_are_refused(plain):
    plain.submit("held", PROMPT, SamplingParams(max_tokens=1), export_kv=True)
    run_until(lambda: plain.get("held").state is State.HELD, plain, what="the request to be held")
    record = plain.get("held")
    with pytest.raises(IllegalTransition, match="'held': no move from HELD to RECEIVING"):
        plain._move(record, State.RECEIVING)
    plain.release("held")
    with pytest.raises(IllegalTransition, match="from FINISHED to FAILED"):
        plain._move(record, State.FAILED)
    plain.commit("held", 7)  # not a reservation: refused, logged, nothing moves
    assert all_free(plain)


def test_shutdown_fails_every_live_record_and_frees_it(decode):
    running = decode.submit("running", PROMPT, LONG)
    decode.advance()
    decode.reserve("reserved", PROMPT[:20], GREEDY, LEASE)
    reserved = decode.attach("reserved")
    decode.close()
    assert events(running)[-1].failure is events(reserved)[-1].failure is Failure.SHUTDOWN
    run_until(lambda: not decode.connector.decode.expecting(), decode, what="the receiver to drop the reservation")
    decode.engine.check_integrity()
    assert decode.engine.stats().num_free_blocks == NUM_BLOCKS and not decode.live()

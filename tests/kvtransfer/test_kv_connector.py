"""kvtransfer/connector.py alone: the decode and prefill connectors over an in-process
transport (tests/fake_kv_transport.py), the real frames and the real receiver state
machine in between; no engine, no services.

    PrefillConnector ── FakeSender ══frames══> FakeReceiver (Inbox) ── DecodeConnector
         poll: done  <──────────────── ack ─────────────────┘            poll: arrived
"""

from __future__ import annotations

import threading

import pytest
import torch

from fake_kv_transport import FakeNetwork, FakeReceiver, FakeSender, Gate
from pdserve.engine.disagg import Reservation
from pdserve.engine.export import ExportSlice
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.connector import DecodeConnector, KVConnector, PrefillConnector, Transport, page_runs
from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.kvtransfer.transfer import Export, ExportPhase, Phase, Transfer
from pdserve.kvtransfer.wire import LayoutMismatch, PagesHeader, encode, sign

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 16, 4, 2, 8
VOCAB = 100
PROMPT = list(range(10, 24))  # 14 tokens: 4 blocks, the last one partial
RESERVED = [11, 3, 4, 9]  # the decode side's blocks for the prompt's 4 block indices
HELD = [5, 6, 7, 2]  # the prefill side's blocks for the same prompt


def kv_cache(seed: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = (LAYERS, BLOCKS, 2, BLOCK_SIZE, HEADS, DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Pair:
    """A decode connector and a prefill connector joined by a fake network."""

    def __init__(self, cached_tokens: int = 0, prefill_dtype: torch.dtype = torch.float32) -> None:
        self.network = FakeNetwork()
        self.decode_kv, self.prefill_kv = kv_cache(), kv_cache(seed=0, dtype=prefill_dtype)
        self.receiver = FakeReceiver(self.network, self.decode_kv)
        self.sender = FakeSender(self.network)
        self.decode = DecodeConnector(self.receiver, self.decode_kv, VOCAB)
        self.prefill = PrefillConnector(self.sender, self.prefill_kv)
        self.cached_tokens = cached_tokens
        self.transfers: dict[str, Transfer] = {}
        self.exports: dict[str, Export] = {}

    def reserve(self, rid: str = "r", params: SamplingParams | None = None) -> Transfer:
        reservation = Reservation(rid, list(RESERVED), self.cached_tokens)
        self.transfers[rid] = self.decode.expect(reservation, PROMPT, params or SamplingParams(max_tokens=4))
        return self.transfers[rid]

    def export(self, rid: str = "r", plan=None, first_token: int | None = 42) -> None:
        """Start the export and run the prefill's layers over the whole prompt."""
        self.exports[rid] = self.prefill.start(rid, PROMPT, plan if plan is not None else self.reserve(rid).plan)
        for layer in range(LAYERS):
            self.prefill.on_layer(layer, [ExportSlice(rid, 0, len(PROMPT), list(HELD))])

    def landed(self, first: int = 0) -> bool:
        """Blocks [first, 4) of the prompt hold the prefill side's pages, byte for byte."""
        return all(torch.equal(self.decode_kv[:, RESERVED[i]], self.prefill_kv[:, HELD[i]]) for i in range(first, 4))


def test_pages_land_in_the_reserved_blocks_and_the_final_frame_commits():
    pair = Pair()
    pair.export()
    update = pair.decode.poll()
    assert update.receiving == ["r"] and not update.arrived  # pages landed, no final yet
    assert pair.landed()
    untouched = [b for b in range(BLOCKS) if b not in RESERVED]
    assert torch.count_nonzero(pair.decode_kv[:, untouched]) == 0  # nothing outside the reservation
    pair.prefill.finish("r", 42)
    update = pair.decode.poll()
    assert update.arrived == {"r": 42} and not update.failed
    assert pair.transfers["r"].phase is Phase.ARRIVED and pair.transfers["r"].missing == 0
    assert pair.decode.expecting() == [] and pair.decode.stats["committed"] == 1
    assert pair.decode.stats["bytes"] == LAYERS * 4 * pair.decode.layout.page_bytes


def test_blocks_the_decoder_holds_are_neither_sent_nor_written():
    pair = Pair(cached_tokens=2 * BLOCK_SIZE)
    pair.export()
    pair.prefill.finish("r", 42)
    assert pair.decode.poll().arrived == {"r": 42}
    assert pair.landed(first=2)
    assert torch.count_nonzero(pair.decode_kv[:, RESERVED[:2]]) == 0
    assert pair.prefill.stats["bytes"] == LAYERS * 2 * pair.prefill.layout.page_bytes


def test_a_request_that_samples_its_own_first_token_ignores_the_senders():
    pair = Pair()
    plan = pair.reserve(params=SamplingParams(max_tokens=4, n=2)).plan
    assert not plan.sample_first_token
    pair.export(plan=plan)
    pair.prefill.finish("r", 42)  # the plan says: no token travels
    assert pair.decode.poll().arrived == {"r": None}


def test_the_ack_frees_the_prefill_side():
    pair = Pair()
    pair.export()
    assert pair.prefill.poll().done == {}  # no final yet: nothing to acknowledge
    pair.prefill.finish("r", 42)
    assert pair.prefill.exporting() == ["r"]  # the blocks wait for the ack
    pair.decode.poll()
    assert pair.exports["r"].phase is ExportPhase.FINAL_SENT
    update = pair.prefill.poll()
    assert list(update.done) == ["r"] and not update.failed
    assert pair.exports["r"].phase is ExportPhase.ACKED
    pair.prefill.cancel(pair.exports["r"], "too late")  # an export reported ended: nothing to stop
    assert pair.prefill.stats["failed"] == 0
    assert pair.prefill.exporting() == [] and pair.prefill.stats["done"] == 1


def test_cancel_while_pages_land_waits_for_the_write():
    """The engine thread cancels while the receiver thread writes pages: cancel says
    False (the blocks are not free yet); the failure is reported once, after the write."""
    pair = Pair()
    pair.network.hold("r")
    pair.export()
    gate = Gate()
    writer = threading.Thread(target=pair.network.release, args=("r", gate))
    writer.start()
    try:
        assert gate.entered.wait(10)
        transfer = pair.transfers["r"]
        assert transfer.phase is Phase.LANDING
        assert pair.decode.cancel(transfer, "deadline exceeded") is False
        assert transfer.phase is Phase.CANCELLING  # the one fact: cancelled while pages land
        assert pair.decode.poll().failed == {}  # the write is still landing
        assert pair.decode.expecting() == ["r"]
    finally:
        gate.open()
        writer.join(10)
    update = pair.decode.poll()
    assert update.failed == {"r": "deadline exceeded"} and not update.arrived
    assert transfer.phase is Phase.CANCELLED and pair.decode.cancel(transfer) is True
    assert pair.decode.expecting() == [] and pair.decode.poll().failed == {}  # reported once
    pair.prefill.finish("r", 42)  # the sender goes on, and hears that the reservation ended
    assert "r" in pair.prefill.poll().failed


def test_cancel_with_nothing_landing_frees_at_once():
    pair = Pair()
    transfer = pair.reserve()
    assert pair.decode.cancel(transfer, "aborted") is True
    assert transfer.phase is Phase.CANCELLED and transfer.reason == "aborted"
    assert pair.decode.expecting() == [] and pair.decode.poll().failed == {}  # the owner already knows
    assert pair.decode.cancel(transfer) is True  # twice: nothing more to stop


def test_a_wrong_sender_is_refused_and_its_unproven_frames_land_nowhere():
    pair = Pair()
    plan = pair.reserve().plan
    stranger = FakeSender(pair.network, peer=b"stranger")
    wrong = plan.__class__(**{**plan.__dict__, "secret": b"x" * 32})  # a plan it guessed
    PrefillConnector(stranger, pair.prefill_kv).start("r", PROMPT, wrong)
    out = stranger.open("r", plan.endpoint, secret=wrong.secret)
    stranger.send_pages(out, 0, page_runs(pair.prefill_kv, 0, 0, 4, HELD), pair.prefill.layout)
    assert pair.network.rejected == ["bad_mac"]
    assert torch.count_nonzero(pair.decode_kv) == 0
    update = pair.decode.poll()
    assert "secret" in update.failed["r"] and not update.arrived  # the reservation's blocks are freed


def test_a_bound_transfer_ignores_a_strangers_frames():
    pair = Pair()
    plan = pair.reserve().plan
    pair.prefill.start("r", PROMPT, plan)
    pair.prefill.on_layer(0, [ExportSlice("r", 0, len(PROMPT), list(HELD))])  # binds "r" to its sender
    stranger = FakeSender(pair.network, peer=b"stranger")
    out = stranger.open("r", plan.endpoint, secret=b"y" * 32)
    out.seq = 1
    stranger.send_pages(out, 1, page_runs(torch.ones_like(pair.prefill_kv), 1, 0, 4, HELD), pair.prefill.layout)
    assert pair.network.rejected == ["wrong_peer"]
    pair.prefill.on_layer(1, [ExportSlice("r", 0, len(PROMPT), list(HELD))])
    pair.prefill.finish("r", 42)
    assert pair.decode.poll().arrived == {"r": 42} and pair.landed()


@pytest.mark.parametrize("gap, why", [(1, "lost"), (-1, "replayed")])
def test_a_sequence_gap_or_replay_fails_the_transfer(gap, why):
    pair = Pair()
    export = pair.prefill.start("r", PROMPT, pair.reserve().plan)
    pair.prefill.on_layer(0, [ExportSlice("r", 0, len(PROMPT), list(HELD))])
    export.seq += gap  # a message lost (or one sent again) on the way
    pair.prefill.on_layer(1, [ExportSlice("r", 0, len(PROMPT), list(HELD))])
    update = pair.decode.poll()
    assert why in update.failed["r"] and not update.arrived
    assert "r" in pair.prefill.poll().failed  # the sender is told: its blocks free now


def test_an_abort_before_the_final_frame_fails_the_reservation_now():
    pair = Pair()
    pair.export()
    pair.prefill.cancel(pair.exports["r"], "prefill worker draining")
    assert pair.prefill.exporting() == [] and pair.exports["r"].phase is ExportPhase.CANCELLED
    update = pair.decode.poll()
    assert update.failed == {"r": "sender aborted: prefill worker draining"}
    assert pair.prefill.stats["failed"] == 0  # an abort the owner chose, not a failure


def test_a_final_frame_with_pages_missing_fails():
    pair = Pair()
    pair.prefill.start("r", PROMPT, pair.reserve().plan)
    pair.prefill.on_layer(0, [ExportSlice("r", 0, len(PROMPT), list(HELD))])  # layer 1 never sent
    pair.prefill.finish("r", 42)
    assert "pages never arrived" in pair.decode.poll().failed["r"]
    assert pair.prefill.poll().failed["r"].startswith("receiver:")


def test_a_first_token_outside_the_vocabulary_fails_the_transfer():
    pair = Pair()
    pair.export()
    pair.prefill.finish("r", VOCAB + 5)
    update = pair.decode.poll()
    assert "first_tokens" in update.failed["r"] and not update.arrived


def test_a_layout_mismatch_is_refused_before_any_page_leaves():
    pair = Pair(prefill_dtype=torch.float16)
    plan = pair.reserve().plan
    with pytest.raises(LayoutMismatch, match="dtype"):
        pair.prefill.start("r", PROMPT, plan)
    assert pair.prefill.exporting() == [] and pair.sender.counters["messages"] == 0
    assert pair.decode.expecting() == ["r"]  # the reservation waits for its owner's deadline


def test_pages_of_another_layout_are_dropped_on_arrival():
    pair = Pair()
    plan = pair.reserve().plan
    header = PagesHeader("r", 0, 0, ((0, 1),), (pair.decode.layout.page_bytes // 2,), "float16",
                         pair.decode.layout.wire_page)
    pair.network.send(plan.endpoint, pair.sender.peer, "r", [encode(sign(header, plan.secret)),
                                                               b"\0" * (pair.decode.layout.page_bytes // 2)])
    assert pair.network.rejected == ["bad_layout"] and torch.count_nonzero(pair.decode_kv) == 0


def test_a_plan_for_another_prompt_is_refused():
    pair = Pair(cached_tokens=BLOCK_SIZE)
    plan = pair.reserve().plan
    with pytest.raises(ValueError, match="cached_block_hashes"):
        pair.prefill.start("r", [t + 1 for t in PROMPT], plan)
    with pytest.raises(ValueError, match="num_tokens"):
        pair.prefill.start("r", PROMPT[:-1], plan)
    with pytest.raises(ValueError, match="not 'other'"):
        pair.prefill.start("other", PROMPT, plan)


def test_an_unreachable_receiver_fails_the_start():
    pair = Pair()
    plan = pair.reserve().plan
    pair.receiver.close()
    with pytest.raises(Exception, match="no receiver"):
        pair.prefill.start("r", PROMPT, plan)
    assert pair.prefill.exporting() == []


def test_prompt_logprobs_cannot_take_remote_kv():
    pair = Pair()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        pair.reserve(params=SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert pair.decode.expecting() == [] and pair.receiver.inbox.pending() == []


def test_one_workers_connector_sums_both_sides_stats():
    network = FakeNetwork()
    kv = kv_cache()
    connector = KVConnector(Transport(FakeSender(network), FakeReceiver(network, kv), "fake-sender"), kv, VOCAB)
    assert connector.endpoint == ""  # not started: nothing to advertise yet
    connector.start()
    assert connector.endpoint == "fake://decode"
    assert connector.decode is not None and connector.prefill is not None
    assert connector.stats() == KVTransferStats()
    connector.close()
    connector.close()  # idempotent


def test_page_runs_follow_contiguity_on_both_ends():
    kv = torch.arange(2 * 16 * 2 * 1 * 1 * 1, dtype=torch.float32).reshape(2, 16, 2, 1, 1, 1)
    src = [0, 7, 8, 9, 3, 4]
    dst = [5, 20, 21, 30, 31, 32]
    runs = page_runs(kv, 1, 1, 6, src, dst)
    assert [(first, pages.shape[0]) for first, pages in runs] == [(1, 2), (3, 1), (4, 2)]
    assert torch.equal(runs[0][1], kv[1, 7:9]) and torch.equal(runs[2][1], kv[1, 3:5])
    assert runs[0][1].data_ptr() == kv[1, 7].data_ptr()  # views, not copies
    assert [(f, p.shape[0]) for f, p in page_runs(kv, 0, 1, 6, src)] == [(1, 3), (4, 2)]

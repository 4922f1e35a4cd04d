"""kvtransfer/transfer.py: one record per transfer. A reservation's `Transfer` moves
through its phases as the receiver's inbox fills it (one phase field, no deadline),
and an `Export` is the sending side's only record, the transport's counters in it."""

from __future__ import annotations

import pytest
import torch

from fake_kv_transport import FakeNetwork, FakeReceiver, FakeSender
from pdserve.kvtransfer.inbox import Inbox
from pdserve.kvtransfer.transfer import Export, ExportPhase, Phase, Transfer
from pdserve.kvtransfer.wire import FinalHeader, PageLayout, PagesHeader, new_secret, prompt_digest, sign

PROMPT = list(range(8))  # two blocks of 4
SECRET = b"k" * 32


def inbox_and_transfer() -> tuple[Inbox, Transfer]:
    inbox = Inbox(torch.zeros((1, 4, 2, 4, 1, 2)))
    transfer = Transfer("r", (3, 1), 0, len(PROMPT), prompt_digest(PROMPT), SECRET)
    inbox.expect(transfer)
    return inbox, transfer


def pages_header(layout: PageLayout, seq: int) -> PagesHeader:
    return sign(PagesHeader("r", seq, 0, ((0, 2),), (2 * layout.page_bytes,), layout.dtype, layout.wire_page), SECRET)


def test_a_transfer_moves_through_its_phases_as_its_pages_land():
    inbox, transfer = inbox_and_transfer()
    assert transfer.phase is Phase.EXPECTED and not transfer.started and transfer.missing == 2
    with inbox.pages(pages_header(inbox.layout, 0), b"peer"):
        assert transfer.phase is Phase.LANDING and transfer.started
    assert transfer.phase is Phase.RECEIVING and transfer.missing == 0 and transfer.peer == b"peer"
    inbox.final(sign(FinalHeader("r", 1, len(PROMPT), prompt_digest(PROMPT), ()), SECRET), b"peer")
    assert transfer.phase is Phase.ARRIVED and transfer.phase.ended and inbox.pending() == []


def test_a_cancel_while_pages_land_is_one_phase():
    inbox, transfer = inbox_and_transfer()
    with inbox.pages(pages_header(inbox.layout, 0), b"peer"):
        assert inbox.cancel("r", "expired") is False
        assert transfer.phase is Phase.CANCELLING and not transfer.phase.ended
    assert transfer.phase is Phase.CANCELLED and transfer.reason == "expired"
    [event] = inbox.take_events()
    assert not event.ok and event.reason == "expired"


@pytest.mark.parametrize("end, phase", [
    (lambda inbox: inbox.cancel("r", "aborted"), Phase.CANCELLED),
    (lambda inbox: inbox.fail_peer(b"nobody", "sender gone", "r"), Phase.FAILED),
])
def test_a_transfer_ends_once_cancelled_or_failed(end, phase):
    inbox, transfer = inbox_and_transfer()
    end(inbox)
    assert transfer.phase is phase and transfer.phase.ended and inbox.pending() == []
    with pytest.raises(ValueError, match="expected before"):  # a record is never reused
        inbox.expect(transfer)


def test_an_export_is_the_senders_record_and_the_transports_counters():
    network = FakeNetwork()
    FakeReceiver(network, torch.zeros((1, 4, 2, 4, 1, 2)))
    sender = FakeSender(network)
    export = sender.open("r", "fake://decode", secret=new_secret())
    assert isinstance(export, Export) and export.phase is ExportPhase.SENDING and not export.phase.ended
    assert (export.seq, export.nbytes) == (0, 0)
    sender.send_abort(export, "never mind")
    assert export.seq == 0  # an abort is not numbered
    assert {p for p in ExportPhase if p.ended} == {ExportPhase.ACKED, ExportPhase.FAILED, ExportPhase.CANCELLED}

"""kvtransfer/transports/channel.py, the control channel every transport shares: what
its receiver admits per frame, and that closing it ends every reservation it held."""

from __future__ import annotations

from pdserve.kvtransfer.transfer import Transfer
from pdserve.kvtransfer.transports.channel import FRAME_OVERHEAD
from pdserve.kvtransfer.transports.zmq import ZmqConfig, ZmqReceiver
from pdserve.kvtransfer.wire import MAX_HEADER_BYTES, PageLayout, new_secret, prompt_digest


def test_the_longest_frame_admitted_is_a_header_a_frame_or_a_page(tiny_kv):
    page = PageLayout.of(tiny_kv).page_bytes
    small = ZmqReceiver(tiny_kv, "tcp://127.0.0.1:0", ZmqConfig(max_frame_bytes=page))
    assert small.max_message_bytes == MAX_HEADER_BYTES + FRAME_OVERHEAD
    big = ZmqReceiver(tiny_kv, "tcp://127.0.0.1:0", ZmqConfig(max_frame_bytes=4 * MAX_HEADER_BYTES))
    assert big.max_message_bytes == 4 * MAX_HEADER_BYTES + FRAME_OVERHEAD


def test_closing_the_receiver_fails_every_reservation_it_holds(tiny_kv):
    receiver = ZmqReceiver(tiny_kv, "tcp://127.0.0.1:0")
    assert receiver.start().startswith("tcp://127.0.0.1:")
    receiver.expect(Transfer("a", [0, 1], 0, 8, prompt_digest(list(range(8))), new_secret()))
    receiver.expect(Transfer("b", [2], 0, 4, prompt_digest(list(range(4))), new_secret()))
    told = []
    receiver.on_events = lambda: told.append(True)
    receiver.close()
    events = receiver.events()
    assert sorted((e.request_id, e.ok, e.reason) for e in events) == [
        ("a", False, "receiver closed"), ("b", False, "receiver closed")]
    assert told and receiver.inbox.pending() == []

"""kvtransfer/transports/zmq.py over real sockets in one process: CURVE admits only
authorized senders, the largest frames fit, and the module never shadows pyzmq."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import zmq

from cluster_helpers import wait_for
from pdserve.kvtransfer.transfer import Transfer
from pdserve.kvtransfer.transports.zmq import CurveConfig, ZmqConfig, ZmqReceiver, ZmqSender
from pdserve.kvtransfer.wire import PageLayout, TransferError, new_secret, prompt_digest

WAIT_S = 60.0


def _send_whole(sender: ZmqSender, target_rid: str, endpoint: str, src: torch.Tensor, prompt: list[int],
                secret: bytes, server_key: bytes | None = None) -> None:
    out = sender.open(target_rid, endpoint, server_key, secret=secret)
    layout = PageLayout.of(src)
    for layer in range(layout.num_layers):
        sender.send_pages(out, layer, [(0, src[layer, 0:2])], layout)
    sender.send_final(out, len(prompt), prompt_digest(prompt), [5])


def test_curve_admits_only_authorized_senders(certs, tiny_kv):
    server = CurveConfig.from_files(certs / "server" / "server.key_secret", authorized=certs / "authorized")
    receiver = ZmqReceiver(tiny_kv, "tcp://127.0.0.1:0", ZmqConfig(curve=server))
    endpoint = receiver.start()
    prompt = list(range(8))
    src = torch.randn((2, 8, 2, 4, 1, 8)).half()
    senders = {
        "authorized": ZmqSender(ZmqConfig(curve=CurveConfig.from_files(certs / "client" / "client.key_secret", certs / "server" / "server.key"))),
        "stranger": ZmqSender(ZmqConfig(curve=CurveConfig.from_files(certs / "stranger" / "stranger.key_secret", certs / "server" / "server.key"))),
        "plaintext": ZmqSender(),
    }
    try:
        for i, (who, sender) in enumerate(senders.items()):
            secret = new_secret()
            receiver.expect(Transfer(who, [2 * i, 2 * i + 1], 0, len(prompt), prompt_digest(prompt), secret))
            try:
                _send_whole(sender, who, endpoint, src, prompt, secret)
            except TransferError:
                # A refused peer's connection can be torn down before its few messages
                # are queued (the send finds no pipe): refused all the same. Only the
                # authorized sender must get through.
                if who == "authorized":
                    raise
        events = {}
        deadline = time.monotonic() + WAIT_S
        while "authorized" not in events and time.monotonic() < deadline:
            events.update({e.request_id: e for e in receiver.events()})
            time.sleep(0.01)
        assert events["authorized"].ok and events["authorized"].first_tokens == (5,)
        assert torch.equal(receiver.inbox.kv[:, 0:2].view(torch.int16), src[:, 0:2].view(torch.int16))
        # The others never got a message in: their reservations wait, untouched, until
        # their owner gives up on them (at its deadline).
        wait_for(lambda: receiver.stats().get("refused_peers", 0) >= 1, WAIT_S, "the stranger's handshake to be refused")
        assert sorted(receiver.inbox.pending()) == ["plaintext", "stranger"]
        for who in ("stranger", "plaintext"):
            assert receiver.cancel(who, "deadline exceeded")
        while len(events) < 3 and time.monotonic() < deadline:
            events.update({e.request_id: e for e in receiver.events()})
            time.sleep(0.01)
        for who in ("stranger", "plaintext"):
            assert not events[who].ok and "deadline" in events[who].reason
        stats = receiver.stats()
        assert stats["refused_peers"] >= 1  # the stranger's key, at the handshake
        assert stats["messages"] == 2 and stats["rejected"] == 0  # nothing else got in
        assert torch.count_nonzero(receiver.inbox.kv[:, 2:]) == 0
        # The authorized sender also got its ack, over the encrypted channel.
        acks = []
        while not acks and time.monotonic() < deadline:
            acks = senders["authorized"].poll()
        assert acks[0].ok and acks[0].request_id == "authorized"
    finally:
        receiver.close()
        for sender in senders.values():
            sender.close()


def test_curve_frames_of_the_largest_size_arrive(certs):
    """Frames cut at max_frame_bytes, encrypted, still fit the receiver's MAXMSGSIZE."""
    kv = torch.zeros((2, 6, 2, 16, 8, 64))  # 64 KiB pages
    page = PageLayout.of(kv).page_bytes
    server = CurveConfig.from_files(certs / "server" / "server.key_secret", authorized=certs / "authorized")
    client = CurveConfig.from_files(certs / "client" / "client.key_secret", certs / "server" / "server.key")
    receiver = ZmqReceiver(kv, "tcp://127.0.0.1:0", ZmqConfig(curve=server, max_frame_bytes=2 * page))
    sender = ZmqSender(ZmqConfig(curve=client, max_frame_bytes=2 * page))
    src = torch.randn((2, 6, 2, 16, 8, 64))
    prompt = list(range(16 * 5))
    try:
        endpoint = receiver.start()
        secret = new_secret()
        receiver.expect(Transfer("big", [0, 1, 2, 3, 4], 0, len(prompt), prompt_digest(prompt), secret))
        out = sender.open("big", endpoint, secret=secret)
        for layer in range(2):
            sender.send_pages(out, layer, [(0, src[layer, 0:5])], PageLayout.of(kv))  # frames of 2, 2, 1 pages
        sender.send_final(out, len(prompt), prompt_digest(prompt), [])
        deadline, events = time.monotonic() + WAIT_S, []
        while not events and time.monotonic() < deadline:
            events = receiver.events()
            time.sleep(0.01)
        assert events[0].ok, events[0].reason
        assert torch.equal(kv[:, :5], src[:, :5])
    finally:
        receiver.close()
        sender.close()


def test_the_transport_module_does_not_shadow_pyzmq():
    import pdserve.kvtransfer.transports.zmq as transport

    assert transport.zmq is zmq and Path(zmq.__file__).parent.name == "zmq"
    assert Path(transport.__file__).parent.name == "transports" and hasattr(zmq, "Context")


# -- planning, in one process ----------------------------------------------------------

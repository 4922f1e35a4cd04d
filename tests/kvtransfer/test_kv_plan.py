"""kvtransfer/plan.py: the transfer plan round-trips as bytes the router never reads,
and a malformed or inconsistent one is refused naming what is wrong."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.wire import PageLayout, new_secret

LAYOUT = PageLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32", kv_format="f")


def plan(**changes) -> TransferPlan:
    base = TransferPlan("r", "tcp://127.0.0.1:5555", "zmq", LAYOUT, 14, 1, (b"h" * 32,), (9, 3, 4, 5),
                        new_secret(), b"k" * 40, True)
    return dataclasses.replace(base, **changes)


def test_a_plan_round_trips_through_its_bytes():
    p = plan()
    assert TransferPlan.unpack(p.pack()) == p and p.num_blocks == 4
    without_hint = plan(block_ids=(), server_key=None, sample_first_token=False)
    assert TransferPlan.unpack(without_hint.pack()) == without_hint


@pytest.mark.parametrize("changes, match", [
    ({"secret": b""}, "secret"),
    ({"secret": b"short"}, "secret"),
    ({"endpoint": ""}, "endpoint"),
    ({"num_tokens": 0}, "num_tokens"),
    ({"num_tokens": True}, "num_tokens"),
    ({"skip_blocks": 4, "cached_block_hashes": (b"h",) * 4}, "skip_blocks"),  # would skip the last block
    ({"skip_blocks": 2}, "skip_blocks"),  # one hash for two blocks
    ({"block_ids": (1, 2)}, "block_ids"),
    ({"sample_first_token": 1}, "sample_first_token"),
])
def test_an_inconsistent_plan_is_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        plan(**changes).validate()
    with pytest.raises(ValueError, match=match):  # and on arrival, where the router carried it
        TransferPlan.unpack(plan(**changes).pack())


@pytest.mark.parametrize("raw", [
    b"", b"\x81\xa1x\x01", msgpack.packb([1, 2]),
    msgpack.packb({**msgpack.unpackb(plan().pack()), "layout": {"layers": 2}}),  # a layout without its format
])
def test_malformed_bytes_are_refused(raw):
    with pytest.raises(ValueError, match="malformed"):
        TransferPlan.unpack(raw)

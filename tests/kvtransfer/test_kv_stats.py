"""kvtransfer/stats.py: a worker's transfer counters add up field by field."""

from __future__ import annotations

from pdserve.kvtransfer.stats import KVTransferStats


def test_counters_add_field_by_field():
    total = KVTransferStats(100, 2, 1) + KVTransferStats(50, 1, 0)
    assert total == KVTransferStats(kv_transfer_bytes=150, kv_transfers=3, kv_transfer_failures=1)
    assert KVTransferStats() + KVTransferStats() == KVTransferStats()

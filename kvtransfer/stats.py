"""KV-transfer counters of a worker, summed over its connector's sides.

    prefill side: page bytes sent, transfers the receiver acknowledged, transfers failed
    decode side:  page bytes of committed transfers, transfers committed, transfers failed

Field names are the proto's (pb.StatsResponse) and the metrics' (`pdserve:kv_transfers`).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class KVTransferStats:
    kv_transfer_bytes: int = 0
    kv_transfers: int = 0
    kv_transfer_failures: int = 0

    def __add__(self, other: "KVTransferStats") -> "KVTransferStats":
        return KVTransferStats(*(a + b for a, b in zip(astuple(self), astuple(other))))

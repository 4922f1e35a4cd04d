"""The worker's side of KvEvents: its engine's KV event log as a gRPC stream.

A subscriber names the last batch it applied (epoch, seq); it gets the batches after
it, or a snapshot when the log no longer keeps them (a new subscriber, one that fell
more than the log's capacity behind, or one that followed a previous process of this
worker), then each new batch as the engine loop flushes it. A snapshot larger than
SNAPSHOT_PART hashes goes out in parts of one seq (the device pool's hashes first,
then each lower tier's, with KV tiers). The stream ends when the subscriber leaves or
the log is closed (the worker is stopping).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pdserve.engine.kv_events import KvEventBatch, KvEventLog, TierChanges
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

TIERS = {"host": pb.KV_TIER_HOST, "disk": pb.KV_TIER_DISK}  # engine/offload's tier names

SNAPSHOT_PART = 4096  # hashes per snapshot message (~140 KB)
WAIT_SLICE = 1.0  # seconds between checks that the subscriber is still there


def kv_event_stream(log: KvEventLog, request: pb.KvEventsRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.KvEventBatch]:
    seq, epoch = request.since_seq, request.epoch
    while context.is_active() and not log.closed:
        for batch in log.since(seq, epoch):
            yield from messages(batch, log.epoch)
            seq, epoch = batch.seq, log.epoch
        log.wait(seq, WAIT_SLICE)


def messages(batch: KvEventBatch, epoch: str) -> Iterator[pb.KvEventBatch]:
    """One message for a delta; a snapshot in parts of SNAPSHOT_PART hashes."""
    if not batch.snapshot:
        yield pb.KvEventBatch(seq=batch.seq, epoch=epoch, stored=batch.stored, removed=batch.removed,
                              lower=[tier_changes(c) for c in batch.lower])
        return
    parts = [pb.KvEventBatch(stored=part) for part in _parts(batch.stored)]
    for changes in batch.lower:
        parts += [pb.KvEventBatch(lower=[tier_changes(TierChanges(changes.tier, part))])
                  for part in _parts(changes.stored)]
    for i, part in enumerate(parts):
        part.seq, part.epoch, part.snapshot, part.more = batch.seq, epoch, True, i + 1 < len(parts)
        yield part


def tier_changes(changes: TierChanges) -> pb.KvTierChanges:
    return pb.KvTierChanges(tier=TIERS[changes.tier], stored=changes.stored, removed=changes.removed)


def _parts(hashes: tuple[bytes, ...]) -> list[tuple[bytes, ...]]:
    """`hashes` in pieces of SNAPSHOT_PART; one empty piece for none (a part is sent)."""
    return [hashes[start : start + SNAPSHOT_PART] for start in range(0, max(len(hashes), 1), SNAPSHOT_PART)]

"""The router's view of what each worker caches, followed from its KV events.

    worker (KvEvents stream)                router (one KvSubscriber thread per worker)
    snapshot seq=S [parts]   ------------>  view := the snapshot          (a resync)
    delta seq=S+1 {stored, removed} ----->  view += stored, -= removed
              {lower: host/disk changes} -> the same, per lower tier (workers with
                                            KV tiers: the router weighs a hit by tier)
    delta seq=S+3            ------------>  gap: cancel, subscribe again from nothing
    stream breaks (restart, network) ---->  subscribe again after a backoff, from
                                            (epoch, seq): the worker resumes or, if
                                            it cannot, sends a snapshot

The worker flushes one batch per engine iteration that changed its cache, so the
view is at most the batch in flight behind. A view is applied under the registry's
lock, so a routing choice never sees half a batch. The subscriber never drops a
worker: membership stays the registry's (heartbeats, Stats); it stops when its
worker is dropped (the channel closes) or the router stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
RETRY_MIN = 0.1  # seconds before subscribing again after a broken stream, doubling
RETRY_MAX = 2.0
STREAM_LIFETIME = 300.0  # each subscription's deadline; the next one resumes where it ended
_NONE: frozenset[bytes] = frozenset()


class KvView:
    """One worker's cached block hashes as of batch `seq` of `epoch`: `hashes` in its
    device pool, `lower[tier]` in each tier below it (pb.KV_TIER_HOST, KV_TIER_DISK;
    none for a worker without KV tiers)."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.lower: dict[int, set[bytes]] = {}
        self.seq = 0
        self.epoch = ""
        self._incoming: set[bytes] | None = None  # a snapshot arriving in parts
        self._incoming_lower: dict[int, set[bytes]] = {}
        self._incoming_seq = 0

    def apply(self, batch: pb.KvEventBatch) -> bool:
        """Apply one message of the stream; False (nothing applied) when it does not
        follow what was applied before: the caller must resync."""
        if batch.snapshot:
            if self._incoming is None:
                self._incoming, self._incoming_lower, self._incoming_seq = set(), {}, batch.seq
            elif batch.seq != self._incoming_seq:
                return False
            self._incoming.update(batch.stored)
            for changes in batch.lower:
                self._incoming_lower.setdefault(changes.tier, set()).update(changes.stored)
            if not batch.more:
                self.hashes, self.lower, self._incoming = self._incoming, self._incoming_lower, None
                self.seq, self.epoch = batch.seq, batch.epoch
            return True
        if self._incoming is not None or batch.epoch != self.epoch or batch.seq != self.seq + 1:
            return False
        self.hashes.difference_update(batch.removed)
        self.hashes.update(batch.stored)
        for changes in batch.lower:
            held = self.lower.setdefault(changes.tier, set())
            held.difference_update(changes.removed)
            held.update(changes.stored)
        self.seq = batch.seq
        return True

    def tier(self, tier: int) -> set[bytes]:
        """The hashes in lower tier `tier` (empty: none, or no such tier)."""
        return self.lower.get(tier, _NONE)

    def forget_position(self) -> None:
        """Ask for a snapshot next time (the hashes stay until it comes)."""
        self.seq, self.epoch, self._incoming, self._incoming_lower = 0, "", None, {}


class KvSubscriber:
    """Follows one worker's KvEvents into `view` on a daemon thread.

    `lock` guards the view against routing choices; `done()` says when to stop (the
    worker dropped, the router stopping); `stop` is waited on between attempts;
    `count(kind)` is told each 'batch' applied and each resync ('gap', 'snapshot')."""

    def __init__(self, worker_id: str, stub: pb_grpc.WorkerStub, view: KvView, lock: threading.Lock,
                 done: Callable[[], bool], stop: threading.Event, count: Callable[[str], None]) -> None:
        self.worker_id = worker_id
        self.stub = stub
        self.view = view
        self.lock = lock
        self.done = done
        self.stop = stop
        self.count = count
        self.applied = 0  # messages applied (the backoff restarts after a stream that delivered some)
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{worker_id}", daemon=True)

    def start(self) -> KvSubscriber:
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = RETRY_MIN
        while not self.done():
            request = pb.KvEventsRequest(since_seq=self.view.seq, epoch=self.view.epoch)
            applied = self.applied
            try:
                call = self.stub.KvEvents(request, timeout=STREAM_LIFETIME)
                if any(not self._apply(batch) for batch in call):
                    call.cancel()
                    continue  # a gap: resubscribe at once, for a snapshot
                log.info("KV events of %s: the stream ended (the worker is stopping)", self.worker_id)
            except grpc.RpcError as e:
                if self.done():
                    return
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the subscription's lifetime: resume at once
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("worker %s serves no KvEvents: routing ignores its cache", self.worker_id)
                    return
                log.info("KV events of %s: %s (%s)", self.worker_id, e.code().name, e.details())
            except ValueError as e:  # "closed channel": the worker was dropped
                log.info("KV events of %s: %s", self.worker_id, e)
                return
            delay = RETRY_MIN if self.applied > applied else min(2 * delay, RETRY_MAX)
            self.stop.wait(delay)

    def _apply(self, batch: pb.KvEventBatch) -> bool:
        with self.lock:
            after = self.view.seq
            applied = self.view.apply(batch)
            if not applied:
                self.view.forget_position()
        if not applied:
            log.warning("KV events of %s: batch %d does not follow %d: resyncing", self.worker_id, batch.seq, after)
            self.count("gap")
            return False
        self.applied += 1
        self.count("snapshot" if batch.snapshot and not batch.more else "batch")
        return True

"""The router's view of its workers: who is alive, their load, what they cache.

Load comes from heartbeats and a Stats poll every `stats_interval` (counts only);
what a worker caches from its KV events stream, one subscription per worker
(kv_view.py), never more than the batch in flight behind.

A worker is live from a successful Register (the router first checks it answers
Stats) until it is dropped: no heartbeat or Stats answer for `worker_timeout`, or
a Stats poll finds it unreachable. Dropping closes its channel, which cancels every
call in flight to it; the dispatcher sees `handle.dropped` and fails or retries
those requests. A dropped worker that heartbeats again is told NOT_FOUND and
registers anew, so workers join (and rejoin) while the cluster serves.

A worker that leaves (Registry.Leave: it is draining before a launcher stops it) is
`draining`: no new request picks it, calls in flight to it go on, and it is dropped
like any other once it stops answering.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.convert import ROLE_NAMES
from pdserve.services.common.credentials import ClusterAuth
from pdserve.services.router import policy
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.kv_view import KvSubscriber, KvView

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerHandle:
    info: pb.WorkerInfo
    channel: grpc.Channel
    stub: pb_grpc.WorkerStub
    last_seen: float
    inflight: int = 0
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    kv: KvView = field(default_factory=KvView)  # changed under the registry's lock
    dropped: bool = False
    draining: bool = False
    # called (on the monitor thread) when the worker is dropped: see WorkerRegistry.watch
    watchers: set[Callable[[], None]] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def cached(self) -> set[bytes]:
        """Block hashes the worker caches, as of the last KV event batch applied."""
        return self.kv.hashes

    @property
    def cached_lower(self) -> tuple[set[bytes], ...]:
        """Block hashes in the worker's KV tiers below its pool (host, disk; empty sets
        without tiers), as of the last KV event batch applied."""
        return self.kv.tier(pb.KV_TIER_HOST), self.kv.tier(pb.KV_TIER_DISK)

    @property
    def role(self) -> str:
        return ROLE_NAMES.get(self.info.role, "unknown")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "mixed")

    @property
    def can_prefill_remote(self) -> bool:
        return self.role in ("prefill", "mixed") and bool(self.info.kv_endpoint)

    def load(self) -> policy.Load:
        return policy.Load(self.worker_id, self.inflight, self.running, self.waiting, self.free_blocks, self.cached,
                           *self.cached_lower)


class WorkerRegistry:
    def __init__(self, config: RouterConfig, model_name: str, max_model_len: int,
                 auth: ClusterAuth | None = None, count_kv: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.auth = auth or ClusterAuth()  # what the router presents to its workers
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._lock = threading.Lock()
        self._joined = threading.Condition(self._lock)  # notified when a worker registers
        self._workers: dict[str, WorkerHandle] = {}
        self._stop = threading.Event()
        self._probe = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="worker-monitor", daemon=True)
        self._prefill_turn = 0  # round_robin: prefill choices made so far
        self._count_kv = count_kv or (lambda _kind: None)  # KV event batches and resyncs, for metrics

    # -- membership ---------------------------------------------------------------------

    def register(self, info: pb.WorkerInfo) -> None:
        """Add (or replace) a worker after checking it fits and answers. Raises
        ValueError naming the mismatching field, or ConnectionError.

        The same process registering again (same address and pid: a worker that
        re-joins every router it lost touch with) keeps its handle: replacing it would
        close the channel, and with it the calls in flight. It is no longer draining."""
        self._check_compatible(info)
        with self._lock:
            same = self._workers.get(info.worker_id)
            if same is not None and not same.dropped and same.info == info:
                same.last_seen = time.monotonic()
                if same.draining:  # it left, and registers again: it serves again (a worker
                    same.draining = False  # that left never registers again on its own)
                    log.info("worker %s serves again", info.worker_id)
                return
        channel = self.auth.channel(info.address)
        stub = pb_grpc.WorkerStub(channel)
        try:
            stats = stub.Stats(pb.StatsRequest(), timeout=self.config.worker_timeout)
        except grpc.RpcError as e:
            channel.close()
            raise ConnectionError(f"address: {info.address} does not answer Stats ({e.code().name})") from e
        handle = WorkerHandle(pb.WorkerInfo(), channel, stub, time.monotonic())
        handle.info.CopyFrom(info)
        self._apply_stats(handle, stats)
        with self._lock:
            old = self._workers.pop(info.worker_id, None)
            self._workers[info.worker_id] = handle
            self._joined.notify_all()
        if old is not None:
            self._close(old, "replaced by a new registration")
        KvSubscriber(info.worker_id, stub, handle.kv, self._lock, lambda: handle.dropped or self._stop.is_set(),
                     self._stop, self._count_kv).start()
        log.info("worker %s (%s) joined at %s", info.worker_id, handle.role, info.address)

    def _check_compatible(self, info: pb.WorkerInfo) -> None:
        if not info.worker_id:
            raise ValueError("worker.worker_id: must not be empty")
        if info.role not in ROLE_NAMES:
            raise ValueError(f"worker.role: unknown role {info.role}")
        if not info.address:
            raise ValueError("worker.address: must not be empty")
        if info.model != self.model_name:
            raise ValueError(f"worker.model: serves {info.model!r}, this router serves {self.model_name!r}")
        if info.block_size != self.config.block_size:
            raise ValueError(f"worker.block_size: {info.block_size}, the router hashes blocks of {self.config.block_size}")
        if info.max_model_len < self.max_model_len:
            raise ValueError(f"worker.max_model_len: {info.max_model_len} < the router's {self.max_model_len}")
        if info.kv_layout:
            with self._lock:
                others = {h.info.kv_layout for h in self._workers.values()
                          if h.worker_id != info.worker_id and h.info.kv_layout}
            if others and info.kv_layout not in others:
                raise ValueError(
                    f"worker.kv_layout: {info.kv_layout!r}, the registered workers hold {sorted(others)[0]!r}: KV "
                    "pages move as stored, never converted; start every worker with the same --dtype, "
                    "--quantization, --kv-cache-dtype and checkpoint (and the same EAGLE head in --speculative-config: "
                    "a prefill worker's head state fills its decode worker's)")

    def heartbeat(self, worker_id: str, load: pb.Load) -> bool:
        """False when the worker is unknown (it must register again)."""
        with self._lock:
            handle = self._workers.get(worker_id)
            if handle is None:
                return False
            handle.last_seen = time.monotonic()
            handle.free_blocks, handle.running, handle.waiting = load.num_free_blocks, load.num_running, load.num_waiting
            return True

    def leave(self, worker_id: str) -> bool:
        """Route no new request to this worker; False when it is not registered."""
        with self._lock:
            handle = self._workers.get(worker_id)
            if handle is None:
                return False
            handle.draining = True
        log.info("worker %s is draining: no new requests", worker_id)
        return True

    def drop(self, handle: WorkerHandle, reason: str) -> None:
        with self._lock:
            if self._workers.get(handle.worker_id) is handle:
                del self._workers[handle.worker_id]
            else:
                return
        self._close(handle, reason)

    def _close(self, handle: WorkerHandle, reason: str) -> None:
        log.warning("dropping worker %s at %s: %s", handle.worker_id, handle.info.address, reason)
        with self._lock:
            handle.dropped = True
            watchers, handle.watchers = list(handle.watchers), set()
        handle.channel.close()  # cancels its calls in flight
        for watcher in watchers:
            try:
                watcher()
            except Exception:
                log.exception("a watcher of %s failed", handle.worker_id)

    def watch(self, handle: WorkerHandle, on_drop: Callable[[], None]) -> Callable[[], None]:
        """Call `on_drop()` once if `handle` is dropped (now, if it already is); returns
        the function that stops watching."""
        with self._lock:
            if not handle.dropped:
                handle.watchers.add(on_drop)
                return lambda: self._unwatch(handle, on_drop)
        on_drop()
        return lambda: None

    def _unwatch(self, handle: WorkerHandle, on_drop: Callable[[], None]) -> None:
        with self._lock:
            handle.watchers.discard(on_drop)

    def live(self) -> list[WorkerHandle]:
        with self._lock:
            return list(self._workers.values())

    def _serving(self) -> list[WorkerHandle]:
        """Workers new requests may pick (under the lock)."""
        return [h for h in self._workers.values() if not h.draining]

    # -- choosing (load is booked under the lock, so concurrent picks spread) ---------------

    def acquire_decode(self, block_hashes: Sequence[bytes], exclude: Collection[WorkerHandle]) -> WorkerHandle | None:
        """The decode worker for a request, booked; None if every serving one is in
        `exclude` (handles, not ids: a worker that registered anew is a new handle)."""
        with self._lock:
            handles = {h.worker_id: h for h in self._serving() if h.can_decode and h not in exclude}
            chosen = policy.pick_decode([h.load() for h in handles.values()], block_hashes, self.config.block_size)
            return self._book(handles, chosen)

    def acquire_prefill(self, block_hashes: Sequence[bytes], exclude: set[str]) -> WorkerHandle | None:
        with self._lock:
            handles = {
                h.worker_id: h for h in self._serving()
                if h.can_prefill_remote and h.worker_id not in exclude and not self._queue_full(h)
            }
            loads = [h.load() for h in handles.values()]
            if self.config.prefill_policy == "round_robin":
                chosen = policy.pick_round_robin(loads, self._prefill_turn)
                self._prefill_turn += 1
            else:
                chosen = policy.pick_prefill(loads, block_hashes, self.config.block_size, self.config.prefill_queue_weight)
            return self._book(handles, chosen)

    def has_remote_prefill(self) -> bool:
        return self.no_remote_prefill() is None

    def no_remote_prefill(self) -> str | None:
        """Why no prefill worker can take a request now (None: one can):
        "no_prefill_worker" (none registered), "draining" (all leaving),
        "queue_full" (all at --max-prefill-queue)."""
        with self._lock:
            senders = [h for h in self._workers.values() if h.can_prefill_remote]
            serving = [h for h in senders if not h.draining]
            if not senders:
                return "no_prefill_worker"
            if not serving:
                return "draining"
            if all(self._queue_full(h) for h in serving):
                return "queue_full"
            return None

    def _queue_full(self, handle: WorkerHandle) -> bool:
        limit = self.config.max_prefill_queue
        return limit > 0 and handle.inflight + handle.waiting >= limit

    def wait_for_decode(self, exclude: Collection[WorkerHandle], timeout: float) -> bool:
        """Wait up to `timeout` s for a serving decode (or mixed) worker not in `exclude`
        (one that joins, or rejoins after a restart); True if there is one."""
        with self._joined:
            return self._joined.wait_for(
                lambda: any(h.can_decode and h not in exclude for h in self._serving()), timeout=max(0.0, timeout))

    @staticmethod
    def _book(handles: dict[str, WorkerHandle], chosen: policy.Load | None) -> WorkerHandle | None:
        if chosen is None:
            return None
        handle = handles[chosen.worker_id]
        handle.inflight += 1
        return handle

    def release(self, handle: WorkerHandle) -> None:
        with self._lock:
            handle.inflight -= 1

    def probe_soon(self) -> None:
        """A call to some worker failed as if it were gone: check everyone now."""
        self._probe.set()

    # -- monitoring ------------------------------------------------------------------------

    def start(self) -> None:
        self._monitor.start()

    def stop(self) -> None:
        self._stop.set()
        self._probe.set()
        if self._monitor.is_alive():
            self._monitor.join(self.config.worker_timeout + 1.0)
        for handle in self.live():
            handle.channel.close()

    def _watch(self) -> None:
        next_poll = 0.0
        tick = max(0.05, min(self.config.heartbeat_interval, self.config.stats_interval) / 2)
        while not self._stop.is_set():
            probe = self._probe.wait(tick)
            self._probe.clear()
            now = time.monotonic()
            for handle in self.live():
                if now - handle.last_seen > self.config.worker_timeout:
                    self.drop(handle, f"not heard from for {now - handle.last_seen:.1f}s")
            if probe or now >= next_poll:
                self._poll_stats()
                next_poll = time.monotonic() + self.config.stats_interval

    def _poll_stats(self) -> None:
        """Every live worker's Stats (load, not hashes), in parallel, each within half
        the worker timeout."""
        timeout = self.config.worker_timeout / 2
        pending = [
            (h, h.stub.Stats.future(pb.StatsRequest(), timeout=timeout)) for h in self.live()
        ]
        for handle, future in pending:
            try:
                stats = future.result(timeout=timeout + 1.0)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and not handle.dropped:
                    self.drop(handle, f"unreachable ({e.details()})")
                continue
            except Exception as e:  # a future that outlived its own deadline
                log.warning("Stats of %s: %s", handle.worker_id, e)
                future.cancel()
                continue
            with self._lock:
                self._apply_stats(handle, stats)
                handle.last_seen = time.monotonic()

    @staticmethod
    def _apply_stats(handle: WorkerHandle, stats: pb.StatsResponse) -> None:
        handle.free_blocks, handle.running, handle.waiting = stats.num_free_blocks, stats.num_running, stats.num_waiting

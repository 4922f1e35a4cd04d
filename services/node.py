"""A worker process of any role: the shared worker core (services/worker) put
together with the role services (services/prefill, services/decode), the KV
connector named by --kv-connector (kvtransfer/registry.py), the Worker gRPC service
(+ health, reflection), registered with every router --router names
(services/worker/registration.py).

    Worker(config).start()  ->  address;   .drain(grace);   .stop()   (in-process, for tests too)
    run(config)             ->  serve until SIGINT/SIGTERM (the `pdserve decode` CLI)

A launcher's Ray actor (launch/ray.py) runs this same Worker after the same
`prepare(config)` as `run`.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer.connector import KVConnector
from pdserve.kvtransfer.registry import KVCredentials, TransportContext, open_connector
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common import log as service_log
from pdserve.services.common.convert import ROLES
from pdserve.services.common.cpus import this_process
from pdserve.services.common.credentials import ClusterAuth
from pdserve.services.common.metrics import metrics_host, worker_metrics
from pdserve.services.common.server import GrpcServer, announce, shutdown_event
from pdserve.services.common.stats import load
from pdserve.services.decode.service import DecodeService
from pdserve.services.prefill.service import PrefillService
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.registration import Routers, worker_limits
from pdserve.services.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)
CONTROL_THREADS = 16  # gRPC threads kept for Abort, Stats, Drain and KvEvents
DRAIN_SETTLE = 0.2


class Worker:
    """Its Worker service is internal: with cluster credentials configured, every call
    but health checks must present them (services/common/credentials.py)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.auth = ClusterAuth(config.credentials)
        self.engine = LLMEngine(config.engine_config())
        try:
            self._build(config)
        except BaseException:
            self.engine.close()  # the KV tiers' worker thread (and a persistent tier's spill)
            raise

    def _build(self, config: WorkerConfig) -> None:
        if config.role == "prefill" and config.speculative_config is not None and self.engine.speculator is None:
            log.info("prefill worker %s: --speculative-config is not used here (only decoding speculates; an "
                     "EAGLE head would run here to hand its state over)", config.id)
        self.metrics = worker_metrics(config.metrics, config.model_name, config.role, config.id)
        kv = KVCredentials(self.auth.kv_curve(), self.auth.rendezvous_token)
        context = TransportContext.from_env(config.role, config.id, self.engine.runner.kv_cache, kv,
                                            kv_format=self.engine.kv_format,
                                            draft=self.engine.draft_layout)
        self.connector: KVConnector = open_connector(config.kv_connector or "", context,
                                                     self.engine.model_config.vocab_size)
        self.loop = EngineLoop(self.engine, connector=self.connector, held_lease=config.held_lease,
                               metrics=self.metrics)
        self.metrics.watch(self.loop.snapshot, self.connector.stats, self.engine.offload,
                           self.engine.structured_compile_times)
        prefill = PrefillService(self.loop, config) if config.role != "decode" else None
        decode = DecodeService(self.loop, config) if config.role != "prefill" else None
        self.decode = decode
        calls = config.grpc_threads or 2 * config.max_num_seqs + 16  # each stream holds a thread
        # Control RPCs (Abort, Stats, Drain, KvEvents) get threads no stream can take:
        # the servicer refuses work calls beyond `calls`, so these always find one.
        threads = calls + CONTROL_THREADS
        self.server = GrpcServer(threads=threads, max_concurrent_rpcs=threads, interceptors=self.auth.interceptors())
        self.servicer = WorkerServicer(config, self.loop, prefill, decode, self.connector.stats, self.drain,
                                       max_calls=calls)
        pb_grpc.add_WorkerServicer_to_server(self.servicer, self.server.grpc)
        self.routers: Routers | None = None
        self.address = ""
        self.metrics_port = 0

    def start(self) -> str:
        """Start the engine thread and the server; register; returns host:port."""
        self.auth.warn_if_open(f"{self.config.role} worker {self.config.id}")
        self.loop.start()  # and the KV connector: its endpoint is known from here on
        self.metrics_port = self.metrics.serve(metrics_host(self.config), self.config.metrics_port)
        port = self.server.start(self.config.host, self.config.port, ["pdserve.v1.Worker"],
                                 self.auth.server_credentials())
        self.address = f"{self.config.advertise_host or self.config.host}:{port}"
        self.server.set_serving()
        if self.config.router:
            self.routers = Routers(self.config.router, self.info(), self._load, self.auth,
                                   self.config.router_resolve_interval)
            self.routers.start(self.config.register_timeout)  # every router, each on its own from here on
        # weights, activation peak, KV bytes per token, blocks, max concurrency (what `pdserve plan` predicts)
        log.info("%s worker %s %s", self.config.role, self.config.id, self.engine.memory.log_line())
        log.info("%s worker %s serving on %s", self.config.role, self.config.id, self.address)
        return self.address

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.config.id, role=ROLES[self.config.role], address=self.address,
            model=self.config.model_name, kv_endpoint=self.connector.endpoint,
            block_size=self.config.block_size, max_model_len=self.engine.max_model_len,
            num_blocks=self.engine.pool.num_blocks, pid=os.getpid(), metrics_port=self.metrics_port,
            kv_layout=self.engine.kv_layout, limits=worker_limits(self.engine.limits),
        )

    def drain(self, grace: float) -> tuple[bool, int]:
        """Leave every router's pools, then wait until nothing is left here (no call in
        flight, no request running, waiting, reserved or held) or `grace` seconds
        pass. Returns (drained, what remained). Idle must hold across two looks
        DRAIN_SETTLE apart: a request the router picked just before it saw us leave
        is still on its way."""
        if self.routers is not None:
            self.routers.leave()
        self.server.set_not_serving()
        give_up = time.monotonic() + grace
        idle_looks = 0
        while True:
            remaining = self._busy()
            idle_looks = idle_looks + 1 if remaining == 0 else 0
            if idle_looks >= 2:
                log.info("%s drained", self.config.id)
                return True, 0
            if time.monotonic() >= give_up:
                log.warning("%s: %d requests or calls left after a %.0fs drain", self.config.id, remaining, grace)
                return False, remaining
            time.sleep(min(DRAIN_SETTLE, max(0.0, give_up - time.monotonic())))

    def _busy(self) -> int:
        try:
            stats = self.loop.stats(5.0)
        except (TimeoutError, RuntimeError):  # a long step, or the engine is gone
            return max(1, self.servicer.calls_in_flight)
        requests = (stats.num_requests_running + stats.num_requests_waiting + stats.num_requests_held
                    + stats.num_requests_reserved)
        return requests + self.servicer.calls_in_flight

    def stop(self, grace: float = 2.0) -> None:
        """Stop at once: requests still open fail with UNAVAILABLE (the engine loop
        ends them before the server stops, so their streams can say so)."""
        if self.routers is not None:
            self.routers.stop()
        self.engine.kv_events.close()  # ends KvEvents streams, which would hold server.stop for its grace
        self.loop.close()  # and the KV connector
        self.engine.close()  # the KV tiers, once the engine thread is done with them
        self.server.stop(grace)
        if self.decode is not None:
            self.decode.write_guard.close()
        self.metrics.close()

    def _load(self) -> pb.Load | None:
        """For heartbeats; None (skip the beat) once the engine thread is gone, so the
        router drops a worker that can no longer serve."""
        if not self.loop.alive:
            return None
        return load(self.loop.snapshot())


def pin(cpus: set[int]) -> None:
    """Pin every thread of this process to `cpus`; threads started later inherit it.
    (sched_setaffinity(0) would move only the calling thread, and imports may have
    started others, e.g. torch's.)"""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that has just ended
            pass
        except OSError as e:
            raise ValueError(f"cpu_affinity: cannot pin to {sorted(cpus)}: {e}") from None


def prepare(config: WorkerConfig) -> None:
    """Process-wide settings a worker process takes before its Worker starts."""
    service_log.configure(config.log_level, config.id)
    if config.cpus is not None:
        pin(config.cpus)
        log.info("pinned to CPUs %s", sorted(config.cpus))
    threads, why = torch_threads(config.torch_threads)
    if threads:
        torch.set_num_threads(threads)
    log.info("torch threads: %d (%s)", torch.get_num_threads(), why)


def torch_threads(asked: int | None) -> tuple[int, str]:
    """The intra-op thread count a worker takes (0: leave torch's) and why: --torch-threads
    when given, else one per CPU this process may use (read after pinning)."""
    if asked is not None:
        return asked, "--torch-threads 0: torch's default" if asked == 0 else "--torch-threads"
    cpus = this_process()
    return cpus.usable, f"one per usable CPU: {cpus.describe()}"


def run(config: WorkerConfig) -> int:
    """Serve until SIGINT/SIGTERM, then drain (leave the router's pools, finish what is
    in flight within --drain-timeout) and stop (failing the rest with UNAVAILABLE)."""
    prepare(config)
    stop = shutdown_event()
    worker = Worker(config)
    try:
        address = worker.start()
        announce(config.role, address, config.address_file)
        _serve_until(stop)
        worker.drain(config.drain_timeout)
    finally:
        worker.stop()
    return 0


def _serve_until(stop: threading.Event) -> None:
    while not stop.wait(1.0):
        pass

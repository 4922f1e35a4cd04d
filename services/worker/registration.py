"""Joining the router: register (retrying until a deadline), then heartbeat.

A heartbeat answered NOT_FOUND means the router does not know this worker (it
dropped it, or restarted): register again, unless the worker has left (it is
draining before it stops: `leave`). A router that does not answer is
retried every interval; the worker keeps serving what it has meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.credentials import ClusterAuth

log = logging.getLogger(__name__)
RPC_TIMEOUT = 5.0


class Registrar:
    def __init__(self, router: str, info: pb.WorkerInfo, load: Callable[[], pb.Load | None],
                 auth: ClusterAuth | None = None) -> None:
        self.router = router
        self.info = info
        self.load = load
        self._channel = (auth or ClusterAuth()).channel(router)
        self._stub = pb_grpc.RegistryStub(self._channel)
        self._stop = threading.Event()
        self._left = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self.interval = 1.0

    def register(self, timeout: float) -> None:
        """Register, retrying with backoff; raises TimeoutError after `timeout` s."""
        give_up = time.monotonic() + timeout
        backoff = 0.1
        while True:
            try:
                reply = self._stub.Register(pb.RegisterRequest(worker=self.info), timeout=RPC_TIMEOUT)
                self.interval = reply.heartbeat_interval_seconds or self.interval
                log.info("registered with router %s as %s", self.router, self.info.worker_id)
                return
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                grpc.StatusCode.UNAUTHENTICATED):
                    raise ValueError(f"router: refused registration: {e.details()}") from e
                if time.monotonic() + backoff > give_up or self._stop.is_set():
                    raise TimeoutError(f"router: {self.router} unreachable for {timeout:.0f}s ({e.code().name})") from e
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def start(self) -> None:
        self._thread.start()

    def leave(self) -> None:
        """Tell the router to send no new request here (heartbeats go on, so calls in
        flight are not cut); never register again. Best effort: a router that does
        not answer is not sending anything new either."""
        self._left.set()
        try:
            self._stub.Leave(pb.LeaveRequest(worker_id=self.info.worker_id), timeout=RPC_TIMEOUT)
            log.info("left the router's pools: draining")
        except grpc.RpcError as e:
            log.warning("leaving %s failed (%s): draining anyway", self.router, e.code().name)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(RPC_TIMEOUT)
        self._channel.close()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                load = self.load()
                if load is None:
                    log.error("engine is gone: no more heartbeats")
                    continue
                self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.info.worker_id, load=load), timeout=RPC_TIMEOUT)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and self._left.is_set():
                    continue  # dropped while draining: that is fine
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("router forgot this worker: registering again")
                    self._register_again()
                else:
                    log.warning("heartbeat to %s failed: %s", self.router, e.code().name)
            except Exception:  # the load callback: never let the heartbeat thread die
                log.exception("heartbeat")

    def _register_again(self) -> None:
        try:
            self.register(timeout=self.interval * 3)
        except (TimeoutError, ValueError) as e:
            log.warning("registering again failed: %s", e)

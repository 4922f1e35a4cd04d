"""Joining the routers: every router --router names, each on its own.

--router is a comma-separated list of Registry addresses (host:port), any of them a
DNS name whose every address is a router (a Kubernetes headless Service), looked up
again every --router-resolve-interval seconds. Each router gets a Registrar:

    Routers ---- resolve --router ----> {address: Registrar}   (new address: a Registrar;
       |                                                        gone: its Registrar stops)
       +-- start(timeout): returns once one router accepted this worker and every
       |   router answered once; raises when a router refuses it, or none accepted it
       |   within `timeout` (the worker exits saying why)
       +-- leave(): every router, at once;  stop()

    Registrar (one thread):  register --accepted--> heartbeat every interval
                               ^  retry with backoff        |
                               +------- NOT_FOUND ----------+   (it dropped this worker,
                                                                 or restarted)

A router that does not answer is retried every interval (its channel reconnects
within one as well); the others are served meanwhile. A worker that has left (it is
draining before it stops) never registers again, with any router.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from pdserve.engine.validation import SamplingLimits
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.addresses import is_ip, join_host_port, lookup
from pdserve.services.common.credentials import ClusterAuth

log = logging.getLogger(__name__)


def worker_limits(limits: SamplingLimits) -> pb.WorkerLimits:
    """What a worker registers of its engine's per-request limits (WorkerInfo.limits):
    the router checks a request against them (services/router/worker_limits.py)."""
    message = pb.WorkerLimits(max_n=limits.max_n, max_logprobs=limits.max_logprobs)
    if limits.max_num_seqs is not None:
        message.max_num_seqs = limits.max_num_seqs
    return message
RPC_TIMEOUT = 5.0
DEFAULT_INTERVAL = 1.0  # until a router's Register reply says its heartbeat interval
MIN_BACKOFF = 0.05
POLL = 0.05
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED)


# -- --router ---------------------------------------------------------------------------

def parse_routers(text: str) -> list[tuple[str, int]]:
    """'a:1,b:2' -> [(host, port)]. Raises ValueError naming `router`."""
    entries = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"router: expected HOST:PORT[,HOST:PORT...], got {text!r}")
        entries.append((host.strip("[]"), int(port)))
    if not entries:
        raise ValueError(f"router: expected HOST:PORT[,HOST:PORT...], got {text!r}")
    return entries


def resolve(entries: list[tuple[str, int]],
            lookup: Callable[[str, int], list[str]] = lookup) -> tuple[dict[str, str], set[str]]:
    """Every router's address -> the name it was found under ('' for an IP given as
    such), and the names that do not resolve now (looked up again later; the routers
    found under them before are kept meanwhile)."""
    routers: dict[str, str] = {}
    unresolved: set[str] = set()
    for host, port in entries:
        if is_ip(host):
            routers.setdefault(join_host_port(host, port), "")
            continue
        try:
            addresses = lookup(host, port)
        except OSError as e:
            log.warning("router: %s does not resolve (%s): looking again later", host, e)
            unresolved.add(host)
            continue
        for address in addresses:
            routers.setdefault(join_host_port(address, port), host)
    return routers, unresolved


# -- one router -------------------------------------------------------------------------

class Registrar:
    """This worker's membership at one router, kept by one thread: register (retrying
    with backoff up to an interval apart), heartbeat every interval, register again
    when the router answers NOT_FOUND."""

    def __init__(self, router: str, info: pb.WorkerInfo, load: Callable[[], pb.Load | None],
                 auth: ClusterAuth | None = None, server_name: str = "") -> None:
        self.router = router
        self.server_name = server_name
        self.info = info
        self.load = load
        auth = auth or ClusterAuth()
        # A router found by name is dialled by address: its certificate carries the name.
        options: list[tuple[str, object]] = [
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(DEFAULT_INTERVAL * 1000)),
        ]
        if server_name and not auth.credentials.cluster_server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        self._channel = auth.channel(router, options)
        self._stub = pb_grpc.RegistryStub(self._channel)
        self._stop = threading.Event()
        self._left = threading.Event()
        self.joined = threading.Event()  # the router holds this worker now
        self.answered = threading.Event()  # the first Register got an answer (or failed)
        self.refused: str | None = None  # the router's last refusal, while it refuses
        self.interval = DEFAULT_INTERVAL
        self._failing = ""  # the last failure logged, to log each change once
        self._thread = threading.Thread(target=self._run, name=f"router-{router}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def leave(self) -> None:
        """Tell the router to send no new request here (heartbeats go on, so calls in
        flight are not cut); never register again. Best effort: a router that does
        not answer is not sending anything new either."""
        self._left.set()
        if not self.joined.is_set():
            return
        try:
            self._stub.Leave(pb.LeaveRequest(worker_id=self.info.worker_id), timeout=RPC_TIMEOUT)
            log.info("left router %s's pools: draining", self.router)
        except grpc.RpcError as e:
            log.warning("leaving %s failed (%s): draining anyway", self.router, e.code().name)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(RPC_TIMEOUT)
        self._channel.close()

    def _run(self) -> None:
        backoff = MIN_BACKOFF
        while not self._stop.is_set():
            if self.joined.is_set() or self._left.is_set():
                self._stop.wait(self.interval)
                if not self._stop.is_set():
                    self._beat()
            elif self._register():
                backoff = MIN_BACKOFF
            else:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.interval)

    def _register(self) -> bool:
        try:
            reply = self._stub.Register(pb.RegisterRequest(worker=self.info), timeout=RPC_TIMEOUT)
        except grpc.RpcError as e:
            if e.code() in REFUSALS:
                self.refused = f"router {self.router}: refused registration: {e.details()}"
                self._failed(self.refused, logging.ERROR)
            else:
                self._failed(f"router {self.router} unreachable ({e.code().name}): retrying")
            self.answered.set()
            return False
        self.interval = reply.heartbeat_interval_seconds or self.interval
        self.refused = None
        self._failing = ""
        self.joined.set()
        self.answered.set()
        log.info("registered with router %s as %s", self.router, self.info.worker_id)
        return True

    def _beat(self) -> None:
        try:
            load = self.load()
            if load is None:
                self._failed("engine is gone: no more heartbeats", logging.ERROR)
                return
            self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.info.worker_id, load=load), timeout=RPC_TIMEOUT)
            if self._failing:
                log.info("router %s answers heartbeats again", self.router)
                self._failing = ""
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                self._failed(f"heartbeat to {self.router} failed: {e.code().name}")
            elif not self._left.is_set():  # dropped while draining is fine
                log.warning("router %s forgot this worker (it dropped it, or restarted): registering again",
                            self.router)
                self.joined.clear()
        except Exception:  # the load callback: never let the thread die
            log.exception("heartbeat")

    def _failed(self, what: str, level: int = logging.WARNING) -> None:
        if what != self._failing:
            log.log(level, "%s", what)
            self._failing = what


# -- every router -----------------------------------------------------------------------

class Routers:
    """This worker's membership at every router --router names (module docstring)."""

    def __init__(self, spec: str, info: pb.WorkerInfo, load: Callable[[], pb.Load | None],
                 auth: ClusterAuth | None = None, resolve_interval: float = 2.0,
                 lookup: Callable[[str, int], list[str]] = lookup) -> None:
        self.spec = spec
        self.entries = parse_routers(spec)
        self.info = info
        self.load = load
        self.auth = auth or ClusterAuth()
        self.resolve_interval = resolve_interval
        self._lookup = lookup
        self._named = any(not is_ip(host) for host, _ in self.entries)
        self._registrars: dict[str, Registrar] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._left = threading.Event()
        self._next_resolve = 0.0
        self._thread = threading.Thread(target=self._resolve_loop, name="routers", daemon=True)

    def registrars(self) -> list[Registrar]:
        with self._lock:
            return list(self._registrars.values())

    def joined(self) -> list[str]:
        """The routers that hold this worker now."""
        return [r.router for r in self.registrars() if r.joined.is_set()]

    def start(self, timeout: float) -> None:
        """Register with every router; returns once one accepted this worker and each
        has answered once (the rest are retried meanwhile). Raises ValueError when a
        router refuses it, TimeoutError when none accepted it within `timeout` s."""
        give_up = time.monotonic() + timeout
        while True:
            self._update()
            registrars = self.registrars()
            refusal = next((r.refused for r in registrars if r.refused), None)
            if refusal:
                self.stop()
                raise ValueError(refusal)
            if any(r.joined.is_set() for r in registrars) and all(r.answered.is_set() for r in registrars):
                break
            if time.monotonic() > give_up:
                self.stop()
                names = ", ".join(r.router for r in registrars) or self.spec
                raise TimeoutError(f"router: none of {names} accepted this worker within {timeout:.0f}s")
            self._stop.wait(POLL)
        if self._named:
            self._thread.start()

    def leave(self) -> None:
        """Leave every router's pools (module docstring), all at once."""
        self._left.set()
        threads = [threading.Thread(target=r.leave, daemon=True) for r in self.registrars()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RPC_TIMEOUT + 1.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(RPC_TIMEOUT)
        with self._lock:
            registrars, self._registrars = list(self._registrars.values()), {}
        for r in registrars:
            r.stop()

    def _resolve_loop(self) -> None:
        while not self._stop.wait(POLL * 4):
            try:
                self._update()
            except Exception:  # a lookup gone wrong must not end the worker's memberships
                log.exception("router: resolving %s", self.spec)

    def _update(self) -> None:
        """Look --router up again when due: a Registrar for each new address, none for
        an address gone (that router is gone: it stops hearing from this worker)."""
        now = time.monotonic()
        if now < self._next_resolve:
            return
        self._next_resolve = now + self.resolve_interval if self._named else float("inf")
        found, unresolved = resolve(self.entries, self._lookup)
        with self._lock:
            gone = [self._registrars.pop(a) for a, r in list(self._registrars.items())
                    if a not in found and r.server_name not in unresolved]
            new = [] if self._left.is_set() else [
                Registrar(a, self.info, self.load, self.auth, name) for a, name in found.items()
                if a not in self._registrars]
            for r in new:
                self._registrars[r.router] = r
        for r in gone:
            log.info("router %s is no longer among %s: leaving it be", r.router, self.spec)
            r.stop()
        for r in new:
            r.start()

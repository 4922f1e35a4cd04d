"""What every launcher shares: the router processes, the workers' configs, waiting for
registration, pool sizes, `pdserve up`.

    Cluster (this file)        routers as child processes; render_worker(); start();
       |                       wait_registered(); reconcile() pool sizes; stop(); up()
       +-- LocalCluster        workers as child processes         (launch/local.py)
       +-- RayCluster          workers as Ray actors, placed by   (launch/ray.py)
                               custom resources

A launcher only says how one worker starts (`_start_worker`), how it stops
(`_stop_worker`) and which of its workers failed to come up (`_failed_workers`).
Every worker's settings come from one function, `render_worker`, and the router's
from `render_router`, and the launcher dials its services in one method (`_channel`):
what the launcher decides per worker is set there and nowhere else, so anything
every launcher must hand its services has one place to go.

Credentials: every launch makes fresh ones (launch/credentials.py): a cluster token
every internal RPC carries and CURVE key pairs for the KV channel, in a private
directory (the launcher's own temporary one, or --secrets-dir); each service gets its
`ClusterCredentials` block, rendered as flags like every other setting, and the
router its public security flags (API keys, TLS) as given. The router serves the
public API on its port and the Registry on its internal one; workers register with
the internal one, and the launcher dials it with the launch's credentials.

Router replicas (--routers N): N router processes, each on its own ports (with fixed
ports, router i takes --port + 2i, and --internal-port, --http-port and
--metrics-port + i where given; 0 stays any free port). Every worker is given every
router's Registry (`--router A,B`) and registers with each; `up` prints one `ready`
line per router, the first router's first (`self.address` and `self.internal_address`
are the first router's).

Pool sizes: the launcher tells every router its sizes at start and then reads the
routers' targets every POLL_TARGETS seconds (`Registry.Scale` with `manager` set);
`pdserve scale --address REGISTRY --cluster-token-file F --decode 3` changes a target at any router, and the
launcher starts workers or drains and stops its newest ones to match (and tells the
other routers the new target). A worker being removed first
leaves the router's pools (no new requests) and finishes what it has within
`--drain-grace` seconds (`Worker.Drain`).

Supervision (`serve`): a child process that exits while the launcher is not stopping
(the router, a LocalCluster's worker), whether it died or was sent SIGTERM and drained
(exit 0: how a rolling restart goes, one process after the other, as Kubernetes
restarts a pod's container whatever its exit code) is started again with the same
command line, after a backoff that doubles while it keeps dying (--restart-backoff,
capped at --restart-backoff-max; launch/supervise.py). Each restart is logged and
printed (`restarted NAME N`); the router keeps the ports it first bound (workers
re-register by themselves, and the launcher tells it the pool sizes again); a worker
keeps its id and registers anew. Workers stopped on purpose (scaled down, shutdown)
are never restarted. Ray restarts its actors itself (`--ray-max-restarts`). A
router's drain must outlast its longest stream (a stream it cuts had tokens: the
client does not replay it), a worker's need not (the router migrates what it
leaves): --router-drain-timeout sets the routers' apart from --drain-timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

import grpc

from pdserve.engine.offload.config import physical_memory
from pdserve.engine.spec.config import EAGLE_METHODS
from pdserve.launch.credentials import LaunchCredentials, generate
from pdserve.launch.prefork import Prefork, PreforkedProcess
from pdserve.launch.supervise import Backoff
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.credentials import ClusterAuth
from pdserve.services.common.flags import check, flag, to_argv
from pdserve.services.common.server import LAUNCHER_PID_ENV
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.pools import POOLS
from pdserve.services.worker.config import DEFAULT_KV_CONNECTOR, WorkerConfig, parse_cpus

if TYPE_CHECKING:
    from pdserve.launch.prometheus import Prometheus

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
# Worker settings the launcher decides per worker, never taken from the template.
PER_WORKER = ("role", "port", "router", "worker_id", "advertise_host", "address_file", "metrics_port",
              "cpu_affinity", "credentials")
LAUNCHERS = ("local", "ray")
WORKER_STARTS = ("fork", "exec")
START_ORDER = ("prefill", "mixed", "decode")
POLL = 0.1
POLL_TARGETS = 0.5
RPC_TIMEOUT = 5.0


@dataclass(frozen=True)
class LaunchConfig:
    launcher: str = flag("local", "local (processes on this machine) | ray (actors on a Ray cluster)")
    prefill: int = flag(1, "prefill workers")
    decode: int = flag(1, "decode workers")
    mixed: int = flag(0, "mixed (prefill + decode) workers")
    startup_timeout: float = flag(180.0, "seconds for every process to be up and registered")
    drain_grace: float = flag(60.0, "seconds a worker scaled away may take to finish its requests")
    secrets_dir: str | None = flag(None, "keep this launch's fresh credentials (cluster token, CURVE keys) here, "
                                         "mode 0700 (default: a private temporary directory, removed at exit)")
    prometheus: bool = flag(False, "also start a Prometheus server scraping every service's /metrics "
                                   "(needs `prometheus` on PATH)")
    supervise: bool = flag(True, "restart the router and workers that die (with backoff), as Kubernetes or Ray would")
    restart_backoff: float = flag(0.5, "seconds before restarting a child that died; doubles while it keeps dying")
    restart_backoff_max: float = flag(10.0, "longest wait before restarting a child that died")
    routers: int = flag(1, "routers (replicas serving the same workers, each on its own ports; every worker "
                           "registers with each)")
    router_drain_timeout: float | None = flag(None, "the routers' --drain-timeout, where it should differ from the "
                                                    "workers' (a router's drain must outlast its longest stream, a "
                                                    "worker's need not: the router migrates what it leaves; "
                                                    "default: --drain-timeout)")
    worker_start: str = flag("fork", "how local workers and routers start: fork (from one helper process that imported "
                                     "torch and pdserve once: a fraction of the CPU and time of a fresh interpreter; "
                                     "Linux) | exec (each a fresh `python -m pdserve` interpreter)")
    worker_cpus: str = flag("", "pin workers to CPUs, one CPU list per worker in start order (prefill, mixed, "
                                "decode), separated by ';', e.g. '0;1' (cycled if shorter; '': not pinned)")

    def __post_init__(self) -> None:
        check(self.launcher in LAUNCHERS, "launcher", f"must be one of {LAUNCHERS}", self.launcher)
        check(self.worker_start in WORKER_STARTS, "worker_start", f"must be one of {WORKER_STARTS}", self.worker_start)
        for role in POOLS:
            check(getattr(self, role) >= 0, role, "must be >= 0", getattr(self, role))
        check(self.decode + self.mixed >= 1, "decode", "need at least one decode or mixed worker", self.decode)
        check(self.routers >= 1, "routers", "must be >= 1", self.routers)
        check(self.router_drain_timeout is None or self.router_drain_timeout >= 0, "router_drain_timeout",
              "must be >= 0", self.router_drain_timeout)
        check(self.startup_timeout > 0, "startup_timeout", "must be > 0", self.startup_timeout)
        check(self.drain_grace >= 0, "drain_grace", "must be >= 0", self.drain_grace)
        check(self.restart_backoff > 0, "restart_backoff", "must be > 0", self.restart_backoff)
        check(self.restart_backoff_max >= self.restart_backoff, "restart_backoff_max", "must be >= --restart-backoff",
              self.restart_backoff_max)
        for cpus in self.cpu_lists:
            parse_cpus(cpus)

    @property
    def cpu_lists(self) -> list[str]:
        return [part.strip() for part in self.worker_cpus.split(";") if part.strip()]


@dataclass(frozen=True)
class ClusterSpec:
    router: RouterConfig
    worker: WorkerConfig  # template: PER_WORKER fields are set for each worker
    launch: LaunchConfig = LaunchConfig()

    def __post_init__(self) -> None:
        """Workers on this machine (--launcher local) share its memory: their host KV tiers
        together must fit it (each worker checks only its own)."""
        workers = self.launch.prefill + self.launch.decode + self.launch.mixed
        memory = physical_memory()
        total = workers * self.worker.kv_offload_host_bytes
        check(self.launch.launcher != "local" or memory is None or total <= memory, "kv_offload_host_bytes",
              f"{workers} workers on this machine x {self.worker.kv_offload_host_bytes} bytes = {total} bytes is "
              f"more than its memory ({memory} bytes)", self.worker.kv_offload_host_bytes)

    @property
    def router_drain_timeout(self) -> float:
        """The routers' --drain-timeout: --router-drain-timeout where given, else the
        --drain-timeout every service shares."""
        given = self.launch.router_drain_timeout
        return self.router.drain_timeout if given is None else given


class StartupError(RuntimeError):
    """The cluster could not come up (a child exited, or the startup deadline passed)."""


def kv_connector(template: WorkerConfig, role: str) -> str:
    """The KV connector a worker of this role runs ('' for none): the template's if it
    names one, else ZeroMQ tcp for prefill and decode workers."""
    if template.kv_connector is not None:
        return template.kv_connector
    return DEFAULT_KV_CONNECTOR if role in ("prefill", "decode") else ""


def speculative_config(template: WorkerConfig, role: str) -> str | None:
    """The template's --speculative-config for the roles that decode; none for prefill
    workers, which never decode (and with a draft model would load it for nothing:
    its KV is computed on the decode worker, never shipped), unless it names an EAGLE
    head: the prefill worker runs it over the prompt and ships its state, and workers
    pair only with the same head (its digest is in their kv_layout)."""
    spec = template.speculative
    return template.speculative_config if role != "prefill" or (spec and spec.method in EAGLE_METHODS) else None


def render_router(spec: ClusterSpec, address_file: Path, credentials: LaunchCredentials, index: int = 0) -> RouterConfig:
    """Router `index`'s settings, for every launcher: the template's, on ports of its
    own (module docstring)."""
    config = spec.router
    ports = {}
    if config.port:
        ports["port"] = config.port + 2 * index
        if config.internal_port is None:
            ports["internal_port"] = config.port + 2 * index + 1
    for name in ("internal_port", "http_port", "metrics_port"):
        value = getattr(config, name)
        if value:  # None or 0 (any free port) stays as it is
            ports[name] = value + index
    return replace(config, address_file=str(address_file), credentials=credentials.for_router(),
                   drain_timeout=spec.router_drain_timeout, **ports)


def router_name(index: int) -> str:
    """A router's child process name: `router` for the first, `router-1`, ... after."""
    return "router" if index == 0 else f"router-{index}"


@dataclass(frozen=True)
class RouterEndpoint:
    """One router as it bound its ports."""

    name: str  # its child process
    address: str  # public API
    internal: str  # Registry
    http: str  # OpenAI-compatible HTTP API ("" without --http-port)
    for_workers: str  # its Registry as workers dial it


def render_worker(
    spec: ClusterSpec, role: str, worker_id: str, router: str, credentials: LaunchCredentials, index: int,
) -> WorkerConfig:
    """One worker's settings, for every launcher: the template with what is decided
    per worker (PER_WORKER). `index` counts the workers started before this one (it
    picks the worker's CPUs from --worker-cpus). The settings a pair's KV pages
    depend on (--quantization, --kv-cache-dtype, --block-size, --dtype) are the
    template's, the same for every role. KV tiers (--kv-offload-*): each worker gets
    the template's host-memory budget, and its own subdirectory of --kv-offload-dir
    (named by its worker id, so a restarted worker finds its blocks again; two workers
    never share one)."""
    cpus = spec.launch.cpu_lists
    return replace(spec.worker, role=role, port=0, metrics_port=0, router=router, worker_id=worker_id,
                   kv_connector=kv_connector(spec.worker, role), credentials=credentials.for_role(role),
                   speculative_config=speculative_config(spec.worker, role),
                   cpu_affinity=cpus[index % len(cpus)] if cpus else spec.worker.cpu_affinity,
                   kv_offload_dir=worker_tier_dir(spec.worker.kv_offload_dir, worker_id))


def worker_tier_dir(template: str | None, worker_id: str) -> str | None:
    """A worker's disk KV tier: its own subdirectory of the template's --kv-offload-dir."""
    return None if template is None else os.path.join(template, worker_id)


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


class Cluster(ABC):
    """A router (child process) and workers started by a subclass."""

    name = "cluster"

    def __init__(self, spec: ClusterSpec, log_dir: str | Path | None = None, python: str = sys.executable) -> None:
        self.spec = spec
        self.python = python
        self.log_dir = Path(log_dir) if log_dir else None
        self.processes: dict[str, subprocess.Popen | PreforkedProcess] = {}  # routers (and LocalCluster's workers)
        self.router_cpus: tuple[int, ...] = ()  # the cores the routers are pinned to (none: unpinned)
        self._cpus: dict[str, tuple[int, ...]] = {}  # a child's cores, for its restarts
        self._extra_env: dict[str, dict[str, str]] = {}  # what a child's environment adds, for its restarts
        self._forked: set[str] = set()  # children forked from the preloaded helper (and their restarts)
        self.prefork: Prefork | None = None  # the helper workers fork from (LocalCluster, --worker-start fork)
        self.routers: list[RouterEndpoint] = []  # as they bound their ports
        self.address = ""  # the first router's public address, as it bound it (what `ready` prints)
        self.internal_address = ""  # its Registry, as it bound it
        self.http_address = ""  # its OpenAI-compatible HTTP API, as it bound it ("" without --http-port)
        self.router_for_workers = ""  # every router's Registry, as workers dial it (--router A,B)
        self.manager_id = f"{self.name}-{os.getpid()}"
        self.pools: dict[str, list[str]] = {role: [] for role in POOLS}  # held worker ids, oldest first
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-")
        secrets_dir = spec.launch.secrets_dir or Path(self._tmp.name) / "credentials"
        self.credentials: LaunchCredentials = generate(secrets_dir, spec.router.credentials)
        self._auth = ClusterAuth(self.credentials.for_client())
        self._logs: list[IO] = []
        self._next_index: dict[str, int] = {}
        self._spawned = 0  # workers started, for the next one's CPUs
        self._lock = threading.Lock()  # pools and the workers' start/stop
        self._retiring: list[threading.Thread] = []
        self._argv: dict[str, list[str]] = {}  # each child's command line, to restart it
        self.backoff = Backoff(spec.launch.restart_backoff, spec.launch.restart_backoff_max)
        self._retell_sizes = False  # a restarted router has forgotten the pool sizes
        self._told: dict[str, int] = {}  # the pool sizes last told to every router

    # -- what a launcher provides -------------------------------------------------------

    @abstractmethod
    def _start_worker(self, worker_id: str, config: WorkerConfig) -> None:
        """Start one worker (without waiting for it to register)."""

    @abstractmethod
    def _stop_worker(self, worker_id: str, grace: float) -> None:
        """Stop one worker for good (idempotent)."""

    @abstractmethod
    def _failed_workers(self) -> dict[str, str]:
        """Workers that cannot come up: worker id -> why."""

    def _this_host(self) -> str:
        """How workers reach this machine when the router listens on every interface."""
        return "127.0.0.1"

    def connect(self) -> None:
        """Reach whatever runs the workers (nothing to do for local processes)."""

    def _stop_all_workers(self, grace: float) -> None:
        for worker_id in self.worker_ids():
            self._stop_worker(worker_id, grace)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, stop: threading.Event | None = None) -> str:
        """Start the router, then every worker; returns the router's address once all
        workers are registered. Raises StartupError (after stopping what started)."""
        deadline = time.monotonic() + self.spec.launch.startup_timeout
        if self.spec.launch.prefill and not kv_connector(self.spec.worker, "prefill"):
            log.warning("prefill workers without a KV connector get no requests (--kv-connector, or --prefill 0)")
        try:
            self.routers = self._start_routers(deadline, stop)
            first = self.routers[0]
            self.address, self.internal_address, self.http_address = first.address, first.internal, first.http
            self.router_for_workers = ",".join(r.for_workers for r in self.routers)
            self._tell_sizes({role: getattr(self.spec.launch, role) for role in POOLS})
            ids = [self._add(role) for role in START_ORDER for _ in range(getattr(self.spec.launch, role))]
            self.wait_registered(ids, deadline, stop)
        except BaseException:
            self.stop()
            raise
        return self.address

    def add_worker(self, role: str, timeout: float | None = None) -> str:
        """Start one more worker while the cluster serves; its id once registered."""
        worker_id = self._add(role)
        self.wait_registered([worker_id], time.monotonic() + (timeout or self.spec.launch.startup_timeout))
        return worker_id

    def stop(self, grace: float = 5.0) -> None:
        """Stop every worker and then the router: SIGTERM, SIGKILL after `grace` s."""
        self._stop_all_workers(grace)
        stop_processes(dict(self.processes), grace)
        if self.prefork is not None:
            self.prefork.close()
            self.prefork = None
        for f in self._logs:
            f.close()
        self._logs.clear()
        self._tmp.cleanup()

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state --------------------------------------------------------------------------

    def worker_ids(self) -> list[str]:
        with self._lock:
            return [w for role in POOLS for w in self.pools[role]]

    def exited(self) -> dict[str, int]:
        """Child processes that have exited, with their exit codes."""
        return {name: p.returncode for name, p in list(self.processes.items()) if p.poll() is not None}

    def live_workers(self, timeout: float = RPC_TIMEOUT) -> list[pb.WorkerInfo]:
        return list(self._list_workers(timeout).workers)

    def metrics_targets(self, timeout: float = RPC_TIMEOUT) -> list[str]:
        """host:port of every service's /metrics: the routers', then each live worker's."""
        replies = [self._list_workers(timeout, router.internal) for router in self.routers[1:]]
        reply = self._list_workers(timeout)
        endpoints = [(self.internal_address, reply.router_metrics_port)]
        endpoints += [(r.internal, other.router_metrics_port) for r, other in zip(self.routers[1:], replies)]
        endpoints += [(w.address, w.metrics_port) for w in reply.workers]
        return [f"{address.rsplit(':', 1)[0]}:{port}" for address, port in endpoints if port]

    def openai_url(self, router: RouterEndpoint | None = None) -> str:
        """The OpenAI base URL of a router's HTTP API (the first router's by default;
        https with the public TLS)."""
        scheme = "https" if self.spec.router.tls_cert else "http"
        return f"{scheme}://{router.http if router else self.http_address}/v1"

    def _list_workers(self, timeout: float, registry: str | None = None) -> pb.ListWorkersResponse:
        with self._channel(registry or self.internal_address) as channel:
            return pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=timeout)

    def reload_api_keys(self) -> None:
        """Have every router read its --api-keys-file again (they reload on SIGHUP)."""
        for router in self.routers:
            process = self.processes.get(router.name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGHUP)

    def wait_registered(self, ids: list[str], deadline: float, stop: threading.Event | None = None) -> None:
        """Until every worker in `ids` is registered with every router."""
        waiting = {(router.internal, worker_id) for router in self.routers for worker_id in ids}
        while waiting:
            self._check_startup(deadline, stop, {worker_id for _, worker_id in waiting})
            for registry in {registry for registry, _ in waiting}:
                try:
                    live = self._list_workers(max(0.1, min(2.0, deadline - time.monotonic())), registry).workers
                except grpc.RpcError:
                    continue
                waiting -= {(registry, w.worker_id) for w in live}
            if waiting:
                time.sleep(POLL)

    # -- pool sizes ---------------------------------------------------------------------

    def reconcile(self) -> None:
        """Read the routers' targets; start workers or retire the newest to match. A
        target that differs from what every router was last told is a change (`pdserve
        scale` at that router): the other routers are told it too."""
        if self._retell_sizes:
            try:
                self._tell_sizes({role: len(self.pools[role]) for role in POOLS})
                self._retell_sizes = False
            except grpc.RpcError:
                return  # a restarted router is not serving yet
        targets = []
        for router in self.routers:
            try:
                targets.append(self._scale({}, router.internal).target)
            except grpc.RpcError as e:
                log.warning("reading the pool targets of %s failed: %s", router.name, e.code().name)
        changed = {}
        for role in POOLS:
            told = self._told.get(role)
            wants = [getattr(t, role) for t in targets if t.HasField(role)]
            changed[role] = next((w for w in wants if w != told), told)
        if changed != self._told and len(self.routers) == 1:
            self._told = changed  # the one router holds it already
        elif changed != self._told:
            try:
                self._tell_sizes({role: n for role, n in changed.items() if n is not None})
            except grpc.RpcError as e:
                log.warning("telling the routers the new pool targets failed: %s", e.code().name)
        for role in POOLS:
            want = changed[role]
            if want is None:
                continue
            while len(self.pools[role]) < want:
                log.info("scaling %s up to %d: starting %s", role, want, self._add(role))
            while len(self.pools[role]) > want:
                with self._lock:
                    worker_id = self.pools[role].pop()
                log.info("scaling %s down to %d: draining %s", role, want, worker_id)
                thread = threading.Thread(target=self._retire, args=(worker_id,), name=f"retire-{worker_id}", daemon=True)
                thread.start()
                self._retiring.append(thread)
        self._retiring = [t for t in self._retiring if t.is_alive()]

    def _retire(self, worker_id: str) -> None:
        """Drain a worker the pools no longer hold (Worker.Drain), then stop it."""
        grace = self.spec.launch.drain_grace
        try:
            address = {w.worker_id: w.address for w in self.live_workers()}.get(worker_id)
            if address:
                with self._channel(address) as channel:
                    reply = pb_grpc.WorkerStub(channel).Drain(pb.DrainRequest(grace_seconds=grace), timeout=grace + 30)
                log.info("%s drained: %s (%d left)", worker_id, reply.drained, reply.remaining)
        except grpc.RpcError as e:
            log.warning("draining %s failed (%s): stopping it", worker_id, e.code().name)
        self._stop_worker(worker_id, grace=5.0)

    def _tell_sizes(self, target: dict[str, int]) -> None:
        """Set these pool targets at every router (raises grpc.RpcError if one fails)."""
        for router in self.routers:
            self._scale(target, router.internal)
        self._told = dict(target)

    def _scale(self, target: dict[str, int], registry: str | None = None) -> pb.ScaleResponse:
        with self._channel(registry or self.internal_address) as channel:
            return pb_grpc.RegistryStub(channel).Scale(
                pb.ScaleRequest(target=pb.PoolSizes(**target), manager=self.manager_id), timeout=RPC_TIMEOUT,
            )

    # -- children -----------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.Channel:
        """The one place the launcher dials an internal service of its cluster (the
        Registry, a worker), presenting this launch's credentials."""
        return self._auth.channel(address)

    channel = _channel  # for operators' tools and tests

    def _add(self, role: str) -> str:
        with self._lock:
            index = self._next_index.get(role, 0)
            self._next_index[role] = index + 1
            worker_id = f"{role}-{index}"
            self.pools[role].append(worker_id)
            spawned, self._spawned = self._spawned, self._spawned + 1
        config = render_worker(self.spec, role, worker_id, self.router_for_workers, self.credentials, spawned)
        self._start_worker(worker_id, config)
        return worker_id

    def _start_routers(self, deadline: float, stop: threading.Event | None) -> list[RouterEndpoint]:
        """Start every router at once; their addresses once each serves its surfaces."""
        configs = {}
        for index in range(self.spec.launch.routers):
            name = router_name(index)
            configs[name] = render_router(self.spec, Path(self._tmp.name) / f"{name}.address", self.credentials, index)
            # forked too (and its restarts): a router imports torch for its tokenizer, which
            # the helper already did (the first start waits for the helper's imports; each
            # restart under load is seconds sooner)
            self._spawn(name, ["router", *to_argv(configs[name])], self.router_cpus, forked=True)
        routers = []
        for name, config in configs.items():
            address_file = Path(config.address_file)
            while not address_file.is_file():
                self._check_startup(deadline, stop, {name})
                time.sleep(POLL)
            public, internal, *http = address_file.read_text().split()
            ports = dict(port=int(public.rpartition(":")[2]), internal_port=int(internal.rpartition(":")[2]))
            if http:
                ports["http_port"] = int(http[0].rpartition(":")[2])
            self._argv[name] = ["router", *to_argv(replace(config, **ports))]  # a restart keeps the ports workers know
            host, _, port = internal.rpartition(":")
            for_workers = f"{self._this_host() if is_wildcard(host) else host}:{port}"
            routers.append(RouterEndpoint(name, public, internal, http[0] if http else "", for_workers))
        return routers

    def _spawn(self, name: str, args: list[str], cpus: tuple[int, ...] = (), extra_env: dict[str, str] | None = None,
               forked: bool = False) -> None:
        """`python -m pdserve ARGS` as a child that exits when this process is gone; on
        `cpus` when given (kept for its restarts), pinned before it runs a line of Python
        so that every thread it starts inherits them. `forked` (kept for its restarts):
        forked from the preloaded helper where there is one (launch/prefork.py), the
        same command line, environment and cores."""
        command = [self.python, "-m", "pdserve", *args]
        env = self.child_env(self._extra_env.setdefault(name, extra_env or {}))
        out: IO | int = 2  # the launcher's stderr: stdout stays for the launcher's own result
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
            self._logs.append(out)
        self._argv.setdefault(name, args)
        pinned = self._cpus.setdefault(name, cpus)
        if forked:
            self._forked.add(name)
        if name in self._forked and self.prefork is not None:
            try:
                self.processes[name] = self.prefork.spawn(command, env, pinned, out if isinstance(out, int)
                                                          else out.fileno())
                log.info("started %s (forked): %s", name, " ".join(command))
                return
            except OSError as e:
                log.warning("forking %s from the preloaded helper failed (%s): starting a fresh interpreter", name, e)
        log.info("starting %s: %s", name, " ".join(command))
        # preexec_fn: only a system call between fork and exec
        pin = (lambda: os.sched_setaffinity(0, pinned)) if pinned else None
        self.processes[name] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                                preexec_fn=pin)

    def child_env(self, extra: dict[str, str]) -> dict[str, str]:
        """A child's environment: this process's, PYTHONPATH to this pdserve, the launcher's
        pid, and what the launch adds (`extra`, never what the operator set)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        env.update({k: v for k, v in extra.items() if k not in env})
        return env

    def _check_startup(self, deadline: float, stop: threading.Event | None, waiting: set[str]) -> None:
        if stop is not None and stop.is_set():
            raise StartupError("interrupted while starting")
        failed = {name: f"exited with {code}" for name, code in self.exited().items()}
        failed.update(self._failed_workers() if self.address else {})
        if failed:
            raise StartupError(f"failed during startup: {failed}")
        if time.monotonic() > deadline:
            raise StartupError(f"not up within {self.spec.launch.startup_timeout:.0f}s: {self._pending(waiting)}")

    def _pending(self, waiting: set[str]) -> str:
        """What the startup still waits for (a launcher may say why)."""
        return str(sorted(waiting))

    def serve(self, stop: threading.Event, prometheus: "Prometheus | None" = None, result: IO[str] | None = None) -> int:
        """`pdserve up` after `ready`: restart children that die (--supervise), keep the
        pools at their targets (and Prometheus' list of endpoints current) until
        `stop`; 1 if every router has exited and none is restarted."""
        reported: set[str] = set()
        next_targets = time.monotonic() + TARGETS_REFRESH
        while not stop.wait(POLL_TARGETS):
            if prometheus is not None and time.monotonic() >= next_targets:
                _refresh_targets(self, prometheus)
                next_targets = time.monotonic() + TARGETS_REFRESH
            if self.spec.launch.supervise:
                self.supervise(result)
            else:
                dead = self.exited()
                if all(router.name in dead for router in self.routers):
                    log.error("every router exited (%s): stopping the cluster",
                              {router.name: dead[router.name] for router in self.routers})
                    return 1
                for name in dead.keys() - reported:
                    log.warning("%s exited with %s", name, dead[name])
                    reported.add(name)
            self.reconcile()
        if self.backoff.total:
            log.info("children restarted while serving: %s", dict(self.backoff.restarts))
        return 0

    def supervise(self, result: IO[str] | None = None) -> None:
        """Schedule a restart of every child that died, and restart those whose backoff
        has passed (with their first command line)."""
        now = time.monotonic()
        pending = set(self.backoff.pending())
        for name, code in self.exited().items():
            if name not in pending:
                delay = self.backoff.died(name, now)
                log.warning("%s exited with %s: restarting it in %.1fs", name, code, delay)
        for name in self.backoff.pending():
            if not self.backoff.due(name, now):
                continue
            if name not in self.processes:  # stopped on purpose meanwhile
                self.backoff.forget(name)
                continue
            self._spawn(name, self._argv[name])
            count = self.backoff.restarted(name, now)
            log.warning("restarted %s (restart %d of it, %d in all)", name, count, self.backoff.total)
            if result is not None:
                print(f"restarted {name} {count}", file=result, flush=True)
            if name in {router.name for router in self.routers}:
                self._retell_sizes = True


def wait_http(base_url: str, timeout: float, stop: threading.Event | None = None) -> None:
    """Until the HTTP API at `base_url` (…/v1) answers GET /version (any TLS certificate:
    this only asks whether it is up). Raises StartupError after `timeout` seconds."""
    import ssl
    import urllib.error
    import urllib.request

    root = base_url.removesuffix("/v1")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    give_up = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{root}/version", timeout=2.0, context=context) as reply:
                reply.read()
                return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > give_up or (stop is not None and stop.is_set()):
            raise StartupError(f"the HTTP API at {root} did not answer within {timeout:.0f}s")
        time.sleep(POLL)


def stop_processes(processes: dict[str, subprocess.Popen | PreforkedProcess], grace: float) -> None:
    """SIGTERM every process, SIGKILL those still there after `grace` seconds."""
    for proc in processes.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    give_up = time.monotonic() + grace
    for name, proc in processes.items():
        try:
            proc.wait(max(0.0, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM for %.0fs: killing it", name, proc.pid, grace)
            proc.kill()
            proc.wait(5.0)


def up(cluster: Cluster) -> int:
    """`pdserve up`: start, print `ready <address> internal <registry address>`, one line
    per router (then `openai http://HOST:PORT/v1` per router with --http-port, once its
    HTTP API answers, and
    `prometheus <url>` with --prometheus), serve until SIGINT/SIGTERM, then SIGTERM
    every child (each drains within --drain-timeout); SIGHUP reloads the router's API
    keys."""
    from pdserve.services.common import log as service_log
    from pdserve.services.common.server import shutdown_event

    service_log.configure(cluster.spec.router.log_level, "launcher")
    result = claim_stdout()
    prometheus = None
    try:
        cluster.connect()  # first: Ray installs signal handlers of its own, ours replace them
        stop = shutdown_event()
        signal.signal(signal.SIGHUP, lambda _signum, _frame: cluster.reload_api_keys())
        cluster.start(stop)
        for router in cluster.routers:
            print(f"ready {router.address} internal {router.internal}", file=result, flush=True)
        for router in cluster.routers:
            if router.http:
                url = cluster.openai_url(router)
                wait_http(url, cluster.spec.launch.startup_timeout, stop)
                print(f"openai {url}", file=result, flush=True)
        if cluster.spec.launch.prometheus:
            prometheus = _start_prometheus(cluster, result)
        return cluster.serve(stop, prometheus, result)
    except StartupError as e:
        log.error("cluster: %s", e)
        return 1
    finally:
        if prometheus is not None:
            prometheus.stop()
        # SIGTERM drains every service (--drain-timeout): let them finish before SIGKILL
        cluster.stop(grace=max(cluster.spec.router_drain_timeout, cluster.spec.worker.drain_timeout) + 5.0)


TARGETS_REFRESH = 5.0  # seconds between re-reading the cluster's /metrics endpoints


def _start_prometheus(cluster: Cluster, result: IO[str]) -> "Prometheus | None":
    from pdserve.launch.prometheus import Prometheus

    targets = cluster.metrics_targets()
    if not targets:
        log.warning("prometheus: no service serves /metrics (--no-metrics?); not starting it")
        return None
    try:
        prometheus = Prometheus.start_if_installed(targets)
    except RuntimeError as e:  # monitoring is not worth stopping the cluster for
        log.error("%s; going on without it", e)
        return None
    if prometheus is None:
        log.warning("prometheus: no `prometheus` binary on PATH (Debian: apt-get install prometheus); going on without it")
        return None
    print(f"prometheus {prometheus.url}", file=result, flush=True)
    return prometheus


def _refresh_targets(cluster: Cluster, prometheus: "Prometheus") -> None:
    try:
        prometheus.set_targets(cluster.metrics_targets())
    except grpc.RpcError as e:
        log.warning("prometheus: cannot list the cluster's endpoints: %s", e.code().name)


def claim_stdout() -> IO[str]:
    """Stdout for the launcher's result alone: a new file on it, while file descriptor 1
    (sys.stdout, and whatever a library writes there: Ray forwards its workers' and
    raylets' output) goes to stderr from now on."""
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return result

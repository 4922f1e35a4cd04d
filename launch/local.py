"""Start a cluster on this machine as separate processes: one router, N workers.

    cluster = LocalCluster(ClusterSpec(router_config, worker_config, LaunchConfig(decode=2)))
    address = cluster.start()           # every worker registered with the router
    ...
    cluster.stop()                      # SIGTERM, then SIGKILL after a grace period

Each child's command line names its role (`python -m pdserve decode --router
... --worker-id decode-0 ...`) and carries every setting as an explicit flag. Unless
the worker template names a KV connector (`--kv-connector`; '' for none), prefill and
decode workers get the ZeroMQ tcp one (KV pages travel from prefill to decode
workers) and mixed workers none (they prefill what they decode themselves). The
router binds the port asked for (0: any) and its internal Registry port, and writes
both addresses to a file the launcher waits for; workers bind any free port and
register with the router's internal address.

Every launch has fresh credentials (launch/credentials.py): a cluster token every
internal RPC carries and CURVE key pairs for the KV channel, in a private directory
(the launcher's own temporary one, or --secrets-dir), passed to each child as the
flags of its `ClusterCredentials` block, with the router's public security flags
(API keys, TLS) as given. Children watch their parent ($PDSERVE_LAUNCHER_PID) and
shut down when the launcher is gone, so even a launcher killed with SIGKILL leaves
no orphans.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

import grpc

from pdserve.launch.credentials import LaunchCredentials, generate
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.credentials import ClusterAuth
from pdserve.services.common.flags import check, flag, to_argv
from pdserve.services.common.server import LAUNCHER_PID_ENV
from pdserve.services.router.config import RouterConfig
from pdserve.services.worker.config import DEFAULT_KV_CONNECTOR, WorkerConfig, parse_cpus

if TYPE_CHECKING:
    from pdserve.launch.prometheus import Prometheus

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
# Worker settings the launcher decides per worker, never taken from the template.
PER_WORKER = ("role", "port", "router", "worker_id", "advertise_host", "address_file", "metrics_port",
              "cpu_affinity")
POLL = 0.1


@dataclass(frozen=True)
class LaunchConfig:
    prefill: int = flag(1, "prefill workers")
    decode: int = flag(1, "decode workers")
    mixed: int = flag(0, "mixed (prefill + decode) workers")
    startup_timeout: float = flag(180.0, "seconds for every process to be up and registered")
    secrets_dir: str | None = flag(None, "keep this launch's fresh credentials (cluster token, CURVE keys) here, "
                                         "mode 0700 (default: a private temporary directory, removed at exit)")
    prometheus: bool = flag(False, "also start a Prometheus server scraping every service's /metrics "
                                   "(needs `prometheus` on PATH)")
    worker_cpus: str = flag("", "pin workers to CPUs, one CPU list per worker in start order (prefill, mixed, "
                                "decode), separated by ';', e.g. '0;1' (cycled if shorter; '': not pinned)")

    def __post_init__(self) -> None:
        for role in ("prefill", "decode", "mixed"):
            check(getattr(self, role) >= 0, role, "must be >= 0", getattr(self, role))
        check(self.decode + self.mixed >= 1, "decode", "need at least one decode or mixed worker", self.decode)
        check(self.startup_timeout > 0, "startup_timeout", "must be > 0", self.startup_timeout)
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


class StartupError(RuntimeError):
    """The cluster could not come up (a child exited, or the startup deadline passed)."""


class LocalCluster:
    def __init__(self, spec: ClusterSpec, log_dir: str | Path | None = None, python: str = sys.executable) -> None:
        self.spec = spec
        self.python = python
        self.log_dir = Path(log_dir) if log_dir else None
        self.processes: dict[str, subprocess.Popen] = {}  # "router" and worker ids
        self.address = ""  # the router's public address
        self.internal_address = ""  # its Registry, where workers register
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-")
        secrets_dir = spec.launch.secrets_dir or Path(self._tmp.name) / "credentials"
        self.credentials: LaunchCredentials = generate(secrets_dir, spec.router.credentials)
        self._auth = ClusterAuth(self.credentials.for_client())
        self._logs: list[IO] = []
        self._next_index: dict[str, int] = {}
        self._spawned = 0

    # -- lifecycle --------------------------------------------------------------------

    def start(self, stop: threading.Event | None = None) -> str:
        """Start the router, then every worker; returns the router's address once all
        workers are registered. Raises StartupError (after stopping what started)."""
        deadline = time.monotonic() + self.spec.launch.startup_timeout
        if self.spec.launch.prefill and not self.kv_connector("prefill"):
            log.warning("prefill workers without a KV connector get no requests (--kv-connector, or --prefill 0)")
        try:
            self.address = self._start_router(deadline, stop)
            ids = [self._spawn_worker(role) for role in ("prefill", "mixed", "decode")
                   for _ in range(getattr(self.spec.launch, role))]
            self.wait_registered(ids, deadline, stop)
        except BaseException:
            self.stop()
            raise
        return self.address

    def add_worker(self, role: str, timeout: float | None = None) -> str:
        """Start one more worker while the cluster serves; its id once registered."""
        worker_id = self._spawn_worker(role)
        self.wait_registered([worker_id], time.monotonic() + (timeout or self.spec.launch.startup_timeout))
        return worker_id

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every child, SIGKILL those still there after `grace` seconds."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        give_up = time.monotonic() + grace
        for name, proc in self.processes.items():
            try:
                proc.wait(max(0.0, give_up - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0fs: killing it", name, proc.pid, grace)
                proc.kill()
                proc.wait(5.0)
        for f in self._logs:
            f.close()
        self._logs.clear()
        self._tmp.cleanup()

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state ------------------------------------------------------------------------

    def exited(self) -> dict[str, int]:
        """Children that have exited, with their exit codes."""
        return {name: p.returncode for name, p in self.processes.items() if p.poll() is not None}

    def channel(self, address: str) -> grpc.Channel:
        """A channel to one of the cluster's internal services (the Registry, a
        worker), presenting this launch's credentials."""
        return self._auth.channel(address)

    def live_workers(self, timeout: float = 5.0) -> list[pb.WorkerInfo]:
        return list(self._list_workers(timeout).workers)

    def metrics_targets(self, timeout: float = 5.0) -> list[str]:
        """host:port of every service's /metrics: the router's, then each live worker's."""
        reply = self._list_workers(timeout)
        endpoints = [(self.address, reply.router_metrics_port)] + [(w.address, w.metrics_port) for w in reply.workers]
        return [f"{address.rsplit(':', 1)[0]}:{port}" for address, port in endpoints if port]

    def _list_workers(self, timeout: float) -> pb.ListWorkersResponse:
        with self.channel(self.internal_address) as channel:
            return pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=timeout)

    def wait_registered(self, ids: list[str], deadline: float, stop: threading.Event | None = None) -> None:
        waiting = set(ids)
        while waiting:
            self._check_startup(deadline, stop, waiting)
            try:
                waiting -= {w.worker_id for w in self.live_workers(timeout=max(0.1, min(2.0, deadline - time.monotonic())))}
            except grpc.RpcError:
                pass
            if waiting:
                time.sleep(POLL)

    def reload_api_keys(self) -> None:
        """Have the router read its --api-keys-file again (it reloads on SIGHUP)."""
        router = self.processes.get("router")
        if router is not None and router.poll() is None:
            router.send_signal(signal.SIGHUP)

    def kv_connector(self, role: str) -> str:
        """The KV connector a worker of this role runs ('' for none)."""
        spec = self.spec.worker.kv_connector
        if spec is not None:
            return spec
        return DEFAULT_KV_CONNECTOR if role in ("prefill", "decode") else ""

    # -- children ---------------------------------------------------------------------

    def _start_router(self, deadline: float, stop: threading.Event | None) -> str:
        address_file = Path(self._tmp.name) / "router.address"
        config = replace(self.spec.router, address_file=str(address_file), credentials=self.credentials.for_router())
        self._spawn("router", ["router", *to_argv(config)])
        while not address_file.is_file():
            self._check_startup(deadline, stop, {"router"})
            time.sleep(POLL)
        public, self.internal_address = address_file.read_text().split()
        return public

    def _spawn_worker(self, role: str) -> str:
        index = self._next_index.get(role, 0)
        self._next_index[role] = index + 1
        worker_id = f"{role}-{index}"
        cpus = self.spec.launch.cpu_lists
        config = replace(self.spec.worker, role=role, port=0, metrics_port=0, router=self.internal_address,
                         worker_id=worker_id, kv_connector=self.kv_connector(role),
                         credentials=self.credentials.for_role(role),
                         cpu_affinity=cpus[self._spawned % len(cpus)] if cpus else self.spec.worker.cpu_affinity)
        self._spawned += 1  # workers started, for the next one's CPUs
        self._spawn(worker_id, [role, *to_argv(config, skip=("role",))])
        return worker_id

    def _spawn(self, name: str, args: list[str]) -> None:
        command = [self.python, "-m", "pdserve", *args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        out: IO | int = 2  # the launcher's stderr: stdout stays for the launcher's own result
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
            self._logs.append(out)
        log.info("starting %s: %s", name, " ".join(command))
        self.processes[name] = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )

    def _check_startup(self, deadline: float, stop: threading.Event | None, waiting: set[str]) -> None:
        if stop is not None and stop.is_set():
            raise StartupError("interrupted while starting")
        dead = self.exited()
        if dead:
            raise StartupError(f"exited during startup: {dead}")
        if time.monotonic() > deadline:
            raise StartupError(f"not up within {self.spec.launch.startup_timeout:.0f}s: {sorted(waiting)}")


def up(spec: ClusterSpec) -> int:
    """`pdserve up`: start, print `ready <address> internal <registry address>` (and
    `prometheus <url>` with --prometheus), serve until SIGINT/SIGTERM; SIGHUP reloads
    the router's API keys."""
    from pdserve.services.common import log as service_log
    from pdserve.services.common.server import shutdown_event

    service_log.configure(spec.router.log_level, "launcher")
    stop = shutdown_event()
    cluster = LocalCluster(spec)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: cluster.reload_api_keys())
    prometheus = None
    try:
        address = cluster.start(stop)
        print(f"ready {address} internal {cluster.internal_address}", flush=True)
        if spec.launch.prometheus:
            prometheus = _start_prometheus(cluster)
        reported: set[str] = set()
        next_targets = time.monotonic() + TARGETS_REFRESH
        while not stop.wait(0.5):
            if prometheus is not None and time.monotonic() >= next_targets:
                _refresh_targets(cluster, prometheus)
                next_targets = time.monotonic() + TARGETS_REFRESH
            dead = cluster.exited()
            if "router" in dead:
                log.error("router exited with %s: stopping the cluster", dead["router"])
                return 1
            for name in dead.keys() - reported:
                log.warning("%s exited with %s", name, dead[name])
                reported.add(name)
        return 0
    except StartupError as e:
        log.error("cluster: %s", e)
        return 1
    finally:
        if prometheus is not None:
            prometheus.stop()
        cluster.stop()


TARGETS_REFRESH = 5.0  # seconds between re-reading the cluster's /metrics endpoints


def _start_prometheus(cluster: LocalCluster) -> "Prometheus | None":
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
    print(f"prometheus {prometheus.url}", flush=True)
    return prometheus


def _refresh_targets(cluster: LocalCluster, prometheus: "Prometheus") -> None:
    try:
        prometheus.set_targets(cluster.metrics_targets())
    except grpc.RpcError as e:
        log.warning("prometheus: cannot list the cluster's endpoints: %s", e.code().name)

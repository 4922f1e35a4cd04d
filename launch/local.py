"""Start a cluster on this machine as separate processes: one router, N workers.

    cluster = LocalCluster(ClusterSpec(router_config, worker_config, LaunchConfig(decode=2)))
    address = cluster.start()           # every worker registered with the router
    ...
    cluster.stop()                      # SIGTERM, then SIGKILL after a grace period

Each child's command line names its role (`python -m pdserve decode --router
... --worker-id decode-0 ...`) and carries every setting as an explicit flag. Unless
the worker template names a KV connector (`--kv-connector`; '' for none), prefill and
decode workers get the ZeroMQ tcp one (KV pages travel from prefill to decode
workers) and mixed workers none (they prefill what they decode themselves); decode
and mixed workers get the template's --speculative-config, prefill workers only
an EAGLE head's (they run it over the prompt and ship its state);
every worker gets the same --quantization and --kv-cache-dtype (the KV pages a
prefill worker ships are read as stored by its decode worker). The
router binds the port asked for (0: any) and writes its address to a file the
launcher waits for; workers bind any free port and register with the router.
Children watch their parent ($PDSERVE_LAUNCHER_PID) and shut down when the
launcher is gone, so even a launcher killed with SIGKILL leaves no orphans. What
every launcher shares (the router, configs, pool sizes) is launch/cluster.py.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from pdserve.launch.cluster import (  # noqa: F401  (the names callers import from here)
    PER_WORKER,
    Cluster,
    ClusterSpec,
    LaunchConfig,
    StartupError,
    kv_connector,
    stop_processes,
)
from pdserve.launch.placement import place_local
from pdserve.launch.prefork import Prefork
from pdserve.launch.prefork import supported as prefork_supported
from pdserve.services.common.cpus import this_process
from pdserve.services.common.flags import to_argv
from pdserve.services.worker.config import WorkerConfig

log = logging.getLogger(__name__)


def worker_argv(config: WorkerConfig) -> list[str]:
    """A worker child's command line after `python -m pdserve`: its role and every flag."""
    return [config.role, *to_argv(config, skip=("role",))]


class LocalCluster(Cluster):
    """Workers as child processes of this one, each on its own share of this machine's
    cores unless the spec says otherwise (launch/placement.py)."""

    name = "local"

    def __init__(self, spec: ClusterSpec, log_dir: str | Path | None = None, python: str = sys.executable) -> None:
        spec, placement, self.placement_line = place_local(spec, this_process())
        super().__init__(spec, log_dir, python)
        self.worker_env = placement.worker_env if placement is not None else {}
        if placement is not None:
            self.router_cpus = placement.routers

    def start(self, stop: threading.Event | None = None) -> str:
        log.info("placement: %s", self.placement_line)
        if self.spec.launch.worker_start == "fork" and prefork_supported() and self.prefork is None:
            # first: it imports torch while the routers start
            self.prefork = Prefork(self.python, self.child_env(self.worker_env))
        return super().start(stop)

    def _start_worker(self, worker_id: str, config: WorkerConfig) -> None:
        self._spawn(worker_id, worker_argv(config), extra_env=self.worker_env, forked=True)

    def _stop_worker(self, worker_id: str, grace: float) -> None:
        proc = self.processes.pop(worker_id, None)  # stopped on purpose: no "exited" report, no restart
        self.backoff.forget(worker_id)
        if proc is not None:
            stop_processes({worker_id: proc}, grace)

    def _stop_all_workers(self, grace: float) -> None:
        pass  # they are child processes: Cluster.stop signals them all at once with the router

    def _failed_workers(self) -> dict[str, str]:
        return {}  # a worker that failed has exited: Cluster.exited() reports it

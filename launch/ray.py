"""Start a cluster on Ray: the routers as the launcher's child processes, every worker
a Ray actor placed by custom resources.

    pdserve up --launcher ray [--address auto|HOST:PORT] [--prefill N --decode M] [--routers R] [flags]

    launcher (Ray driver) ---- router(s) (child processes, as with --launcher local)
        |                          ^ Register / Heartbeat (same as `pdserve decode`)
        +-- placement group (STRICT_PACK) --> WorkerActor --+
              bundle 0: CPU, GPU?, pdserve_prefill|decode     Worker(config): engine,
              bundles 1..g-1: one GPU each (for TP)           gRPC server, KV connector

Routers (`--routers R`): Cluster's, as with --launcher local: R router processes, each
on its own ports, one `ready <public> internal <registry>` line each; every actor is
handed all R Registries (`--router A,B`, reachable from other nodes when the routers
listen on every interface: this node's address) and registers with each, a
restarted actor again.

An actor runs the very service `pdserve prefill|decode|mixed` runs: it receives the
command line that `pdserve ROLE` would get (`to_argv` of the config the launcher
rendered, plain strings: no pickled objects), parses it with the same parser, and
starts the same `Worker` after the same `prepare`. It lives in its own Ray worker
process; if that process dies Ray starts the actor again (`--ray-max-restarts`)
within the same placement group, the new process builds a fresh engine and
registers under the same worker id, and the router routes to it again.

Placement: a prefill worker's bundle asks for one unit of `--ray-prefill-resource`
(default `pdserve_prefill`), a decode or mixed worker's for one unit of
`--ray-decode-resource` (`pdserve_decode`); '' drops the requirement. Nodes offer
them with `ray start --resources '{"pdserve_prefill": 8}'`; a cluster none of whose
nodes offers either default resource (a bare `ray start --head`) takes workers
anywhere.
`--ray-{prefill,decode}-accelerator-type H100` adds Ray's accelerator-type
requirement. Each worker gets `--ray-gpus-per-worker` GPUs (default: 1 with
`--device cuda`, else 0), in a STRICT_PACK placement group (all on one node) whose
first bundle holds the actor; the others wait for tensor-parallel ranks. A worker
with a host KV tier (--kv-offload-host-bytes) reserves that much of Ray's `memory` in
its first bundle, so Ray places it where the memory is; with --kv-offload-dir, each
worker keeps its disk tier in a subdirectory named by its worker id (render_worker).

Connection: `--address auto` joins the cluster `ray start` started on this machine,
`--address HOST:PORT` any cluster's GCS; without it a one-machine cluster is started
(and stopped with the launcher) that offers both pdserve resources, with token
authentication and a token of its own in the launch's private directory. Clusters
with token authentication: the token is read from RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (`ray get-auth-token`), and a token found
there turns token mode on for an explicit HOST:PORT too (Ray does that by itself
only for `auto`; `_enable_token_auth` is the step Ray takes then: the mode in the
environment, and Ray's config, read when ray was imported, reloaded to see it).

Credentials: the launch's fresh ones (launch/cluster.py) reach each actor as the
contents of their files (`credentials.pack`), never as paths on the launcher's disk,
which another node does not share; the actor writes them into a private directory of
its own (`unpack`: 0700, files 0600) and removes it when it stops.

Stopping stops only what this launcher started: its actors (asked to stop, then
killed without restart), their placement groups, the router, and the Ray cluster if
it started one. Actors belong to the launcher's Ray job, so Ray removes them too if
the launcher dies.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
from dataclasses import replace
from pathlib import Path

import ray
from ray._private.authentication.authentication_token_setup import _enable_token_auth
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.launch.cluster import Cluster, ClusterSpec, is_wildcard
from pdserve.launch.credentials import FILE_FIELDS, pack
from pdserve.launch.ray_config import RayConfig
from pdserve.services.common.flags import parse_argv, to_argv
from pdserve.services.worker.config import ROLES, WorkerConfig

log = logging.getLogger(__name__)
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENVS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
LOCAL_RESOURCE_UNITS = 64  # what a launcher-started one-machine cluster offers of each pdserve resource
CALL_TIMEOUT = 30.0
CREDENTIAL_FIELDS = (*FILE_FIELDS, "kv_curve_authorized")  # carried as contents, not paths


def worker_config(argv: list[str]) -> WorkerConfig:
    """The WorkerConfig that `pdserve ROLE ARGV...` runs (what an actor is handed):
    the role's flags, parsed as that command parses them."""
    role = argv[0] if argv else ""
    if role not in ROLES:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
    return parse_argv(WorkerConfig, argv[1:], prog=f"pdserve {role}", role=role)


def actor_argv(config: WorkerConfig) -> list[str]:
    """What an actor is handed for `config`: `pdserve ROLE` and its flags (credentials
    travel apart, as file contents); `worker_config` parses it back."""
    return [config.role, *to_argv(config, skip=CREDENTIAL_FIELDS)]


class WorkerActor:
    """One pdserve worker in a Ray actor: `pdserve ROLE ARGV` in this process."""

    def __init__(self, argv: list[str], credentials: dict[str, dict[str, str]]) -> None:
        import tempfile

        from pdserve.launch.credentials import unpack
        from pdserve.services.node import Worker, prepare

        # The launch's credentials arrive as file contents (this node may not share the
        # launcher's disk) and live in a private directory of this actor's process.
        self._secrets = tempfile.TemporaryDirectory(prefix="pdserve-credentials-")
        config = worker_config(argv)
        config = replace(config, credentials=unpack(credentials, self._secrets.name, config.credentials))
        if is_wildcard(config.host):  # reachable from other nodes: advertise this node's address
            node_ip = ray.util.get_node_ip_address()
            config = replace(config, advertise_host=config.advertise_host or node_ip)
            os.environ.setdefault("PDSERVE_KV_HOST", node_ip)  # where a KV receiver binds (kvtransfer/registry.py)
        prepare(config)
        self.worker_id = config.id
        self.worker = Worker(config)
        self.worker.start()

    def address(self) -> str:
        return self.worker.address

    def stop(self, grace: float) -> None:
        self.worker.stop(grace)
        self._secrets.cleanup()

    def __repr__(self) -> str:  # the actor's name in `ray list actors` and the dashboard
        return f"WorkerActor({self.worker_id})"


RemoteWorker = ray.remote(WorkerActor)


def token_available() -> bool:
    return any(os.environ.get(name) for name in AUTH_TOKEN_ENVS) or (Path.home() / ".ray" / "auth_token").is_file()


class RayCluster(Cluster):
    name = "ray"

    def __init__(self, spec: ClusterSpec, ray_config: RayConfig = RayConfig(), log_dir: str | Path | None = None,
                 python: str = sys.executable) -> None:
        if spec.worker.torch_threads is None:  # an actor's share is what it reserves, not its node's cores
            spec = replace(spec, worker=replace(spec.worker, torch_threads=max(1, int(ray_config.ray_cpus_per_worker))))
        super().__init__(spec, log_dir, python)
        self.ray_config = ray_config
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.groups: dict[str, PlacementGroup] = {}
        self.bundles: dict[str, list[dict[str, float]]] = {}
        self._ready: dict[str, ray.ObjectRef] = {}  # until the actor is up
        self._connected_here = False

    def start(self, stop: threading.Event | None = None) -> str:
        self.connect()
        self._check_resources()
        return super().start(stop)

    def stop(self, grace: float = 5.0) -> None:
        try:
            super().stop(grace)
        finally:
            if self._connected_here:
                ray.shutdown()
                self._connected_here = False

    # -- Ray ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Join the cluster at --address (or start one), unless this process already is
        a Ray driver (a test, a notebook): then use that connection and leave it be."""
        if ray.is_initialized():
            return
        address = self.ray_config.address
        if address is None:
            if AUTH_MODE_ENV not in os.environ and not token_available():
                self._private_token()
            resources = {r: LOCAL_RESOURCE_UNITS for r in (self.ray_config.ray_prefill_resource,
                                                           self.ray_config.ray_decode_resource) if r}
            ray.init(address="local", resources=resources, logging_level=logging.WARNING)
        else:
            if address != "auto" and AUTH_MODE_ENV not in os.environ and token_available():
                _enable_token_auth()  # what Ray does by itself for "auto" only
            ray.init(address=address, logging_level=logging.WARNING)
        self._connected_here = True

    def _private_token(self) -> None:
        """Token auth for the cluster this launch starts, with a token of its own in its
        private directory (Ray would otherwise write ~/.ray/auth_token, readable by all)."""
        path = Path(self._tmp.name) / "ray_auth_token"
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
        _enable_token_auth()

    def _check_resources(self) -> None:
        """A cluster that offers neither of the default pool resources (a bare `ray
        start --head`) places workers anywhere; a resource named by a flag, or one
        the cluster offers on some node, is required (workers wait for such a node)."""
        offered = ray.cluster_resources()
        defaults = RayConfig()
        unused = {name: "" for name in ("ray_prefill_resource", "ray_decode_resource")
                  if getattr(self.ray_config, name) == getattr(defaults, name)
                  and getattr(defaults, name) not in offered}
        if len(unused) == 2:
            log.warning("no node offers %s or %s: workers go to any node with room (mark node groups with "
                        "`ray start --resources`)", defaults.ray_prefill_resource, defaults.ray_decode_resource)
            self.ray_config = replace(self.ray_config, **unused)
        machines = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        if len(machines) > 1 and not is_wildcard(self.spec.worker.host):
            log.warning("the Ray cluster spans %d machines but workers listen on %s only: use --host 0.0.0.0",
                        len(machines), self.spec.worker.host)
        for role in ("prefill", "decode", "mixed"):
            if not getattr(self.spec.launch, role):
                continue
            for name in self.ray_config.bundles(role, self.spec.worker.device)[0]:
                if name not in offered:
                    log.warning("no node of the Ray cluster offers %r, which %s workers need: they wait for one",
                                name, role)

    def _this_host(self) -> str:
        return ray.util.get_node_ip_address()

    # -- workers --------------------------------------------------------------------------

    def _start_worker(self, worker_id: str, config: WorkerConfig) -> None:
        bundles = self.bundles[worker_id] = self.ray_config.bundles(config.role, config.device,
                                                                    config.kv_offload_host_bytes)
        group = placement_group(bundles, strategy="STRICT_PACK", name=f"pdserve-{worker_id}")
        first = bundles[0]
        resource = self.ray_config.resource(config.role)
        actor = RemoteWorker.options(
            num_cpus=first["CPU"], num_gpus=first.get("GPU", 0), memory=first.get("memory"),
            resources={resource: 1} if resource else {},
            accelerator_type=self.ray_config.accelerator_type(config.role),
            max_restarts=self.ray_config.ray_max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(actor_argv(config), pack(config.credentials))
        self.groups[worker_id], self.actors[worker_id] = group, actor
        self._ready[worker_id] = actor.address.remote()

    def _stop_worker(self, worker_id: str, grace: float) -> None:
        self._stop_actors([worker_id], grace)

    def _stop_all_workers(self, grace: float) -> None:
        self._stop_actors(list(self.actors), grace)

    def _stop_actors(self, ids: list[str], grace: float) -> None:
        """Ask each to stop (deregistering, closing its server), then kill it for good
        and free its placement group."""
        with self._lock:
            actors = {w: self.actors.pop(w) for w in ids if w in self.actors}
            groups = [self.groups.pop(w) for w in ids if w in self.groups]
            for w in ids:
                self._ready.pop(w, None)
        stopping = [actor.stop.remote(grace) for actor in actors.values()]
        if stopping:
            ray.wait(stopping, num_returns=len(stopping), timeout=grace + 5.0)
        for actor in actors.values():
            ray.kill(actor, no_restart=True)
        for group in groups:
            remove_placement_group(group)

    def _failed_workers(self) -> dict[str, str]:
        refs = dict(self._ready)
        if not refs:
            return {}
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        failed = {}
        for worker_id, ref in refs.items():
            if ref not in done:
                continue
            try:
                ray.get(ref, timeout=CALL_TIMEOUT)
                self._ready.pop(worker_id, None)
            except ray.exceptions.RayError as e:
                failed[worker_id] = f"{type(e).__name__}: {str(e)[-800:]}"
        return failed

    def _pending(self, waiting: set[str]) -> str:
        parts = []
        for worker_id in sorted(waiting):
            group = self.groups.get(worker_id)
            state = placement_group_table(group).get("state") if group is not None else None
            if state == "PENDING":
                parts.append(f"{worker_id} (no node offers {self.bundles[worker_id]})")
            else:
                parts.append(f"{worker_id} (starting or registering)")
        return ", ".join(parts)

"""A gRPC server with the standard services every pdserve process publishes:
health checking (grpc.health.v1) and server reflection (grpc.reflection.v1alpha).

    server = GrpcServer(threads=32)
    add_MyServicer_to_server(servicer, server.grpc)
    port = server.start("127.0.0.1", 0, ["pdserve.v1.Generation"])   # 0: any free port
    ...
    server.stop(grace=2.0)

Health reports NOT_SERVING until `set_serving()`, and again from `stop()` on, for
the overall server ("") and for each named service. A server may take interceptors
(credential checks: services/common/auth.py) and TLS credentials (`start`); a
request that is no valid message is INVALID_ARGUMENT (services/common/malformed.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.services.common.keepalive import SERVER_OPTIONS
from pdserve.services.common.malformed import MalformedRequests

log = logging.getLogger(__name__)


class GrpcServer:
    def __init__(self, threads: int, max_concurrent_rpcs: int | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = ()) -> None:
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc")
        self.grpc = grpc.server(self._pool, options=SERVER_OPTIONS, maximum_concurrent_rpcs=max_concurrent_rpcs,
                                interceptors=[MalformedRequests(), *interceptors])
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self._services: list[str] = []

    def start(self, host: str, port: int, services: Sequence[str],
              credentials: grpc.ServerCredentials | None = None) -> int:
        """Publish reflection for `services`, bind host:port (TLS with `credentials`)
        and start; returns the port."""
        self._services = list(services)
        names = (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.grpc)
        if credentials is None:
            bound = self.grpc.add_insecure_port(f"{host}:{port}")
        else:
            bound = self.grpc.add_secure_port(f"{host}:{port}", credentials)
        if bound == 0:
            raise OSError(f"port: cannot bind {host}:{port}")
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.start()
        return bound

    def set_serving(self) -> None:
        self._set_all(health_pb2.HealthCheckResponse.SERVING)

    def set_not_serving(self) -> None:
        """Draining: health checks say NOT_SERVING, calls in flight go on."""
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace: float) -> None:
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace).wait(grace + 1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _set_all(self, status: int) -> None:
        for name in ("", *self._services):
            self.health.set(name, status)


# Set by a launcher in its children's environment: the child shuts down when that
# process is no longer its parent (the launcher died, even by SIGKILL).
LAUNCHER_PID_ENV = "PDSERVE_LAUNCHER_PID"
PARENT_CHECK_INTERVAL = 0.5


def shutdown_event() -> threading.Event:
    """An event set by SIGINT or SIGTERM (call from the main thread), or when the
    launcher named in $PDSERVE_LAUNCHER_PID is gone."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %s: shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher:
        threading.Thread(target=_watch_parent, args=(int(launcher), stop), name="parent-watch", daemon=True).start()
    return stop


def _watch_parent(launcher: int, stop: threading.Event) -> None:
    while not stop.wait(PARENT_CHECK_INTERVAL):
        if os.getppid() != launcher:
            log.warning("launcher (pid %d) is gone: shutting down", launcher)
            stop.set()


def announce(role: str, address: str, address_file: str | None, internal: str | None = None,
             http: str | None = None) -> None:
    """Tell whoever started this process where it listens: one stdout line, and the
    address (then the internal one, then the HTTP API's, if any, each on a line of its
    own) written atomically to `address_file` when given (the launcher's way)."""
    import tempfile

    print(f"serving {role} {address}" + (f" internal {internal}" if internal else "")
          + (f" http {http}" if http else ""), flush=True)
    if address_file:
        directory = os.path.dirname(os.path.abspath(address_file))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".address-")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(a for a in (address, internal, http) if a))
        os.replace(tmp, address_file)

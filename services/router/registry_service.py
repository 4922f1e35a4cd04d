"""pdserve.v1.Registry: workers register and heartbeat; operators list them."""

from __future__ import annotations

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.pools import POOLS, NoManager, PoolTargets
from pdserve.services.router.registry import WorkerRegistry


class RegistryServicer(pb_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry, config: RouterConfig) -> None:
        self.registry = registry
        self.config = config
        self.metrics_port = 0  # the router's own /metrics, once serving
        self.targets = PoolTargets()

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        try:
            self.registry.register(request.worker)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ConnectionError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.RegisterResponse(
            heartbeat_interval_seconds=self.config.heartbeat_interval, timeout_seconds=self.config.worker_timeout,
        )

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        if not self.registry.heartbeat(request.worker_id, request.load):
            context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id: {request.worker_id!r} is not registered")
        return pb.HeartbeatResponse()

    def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.ServicerContext) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=[h.info for h in self.registry.live()], router_metrics_port=self.metrics_port)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        if not self.registry.leave(request.worker_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id: {request.worker_id!r} is not registered")
        return pb.LeaveResponse()

    def Scale(self, request: pb.ScaleRequest, context: grpc.ServicerContext) -> pb.ScaleResponse:
        live, draining = self._pool_sizes()
        target = {pool: getattr(request.target, pool) for pool in POOLS if request.target.HasField(pool)}
        try:
            targets = self.targets.set(target, live, request.manager) if target else self.targets.read(request.manager)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"target.{e}")
        except NoManager as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.ScaleResponse(
            target=pb.PoolSizes(**targets), live=pb.PoolSizes(**live), draining=pb.PoolSizes(**draining),
            manager=self.targets.manager(),
        )

    def _pool_sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        live, draining = dict.fromkeys(POOLS, 0), dict.fromkeys(POOLS, 0)
        for handle in self.registry.live():
            if handle.role in POOLS:
                (draining if handle.draining else live)[handle.role] += 1
        return live, draining

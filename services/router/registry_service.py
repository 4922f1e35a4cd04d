"""pdserve.v1.Registry: workers register and heartbeat; operators list them."""

from __future__ import annotations

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.registry import WorkerRegistry


class RegistryServicer(pb_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry, config: RouterConfig) -> None:
        self.registry = registry
        self.config = config
        self.metrics_port = 0  # the router's own /metrics, once serving

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

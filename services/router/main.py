"""The router process: Generation (public) + Registry (workers), health, reflection.

    Router(config).start() -> address;  .stop()      (in-process, for tests too)
    run(config)  -> serve until SIGINT/SIGTERM        (the `pdserve router` CLI)
"""

from __future__ import annotations

import logging

from pdserve.engine.config import ModelConfig
from pdserve.engine.tokenizer import Tokenizer, has_tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common import log as service_log
from pdserve.services.common.server import GrpcServer, announce, shutdown_event
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import Dispatcher
from pdserve.services.router.registry import WorkerRegistry
from pdserve.services.router.registry_service import RegistryServicer
from pdserve.services.router.service import GenerationServicer
from pdserve.services.router.validate import Limits

log = logging.getLogger(__name__)
SPARE_THREADS = 16  # beyond Generate streams: registry, health, reflection, ListModels


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        model = ModelConfig.from_dir(config.model)
        max_model_len = config.max_model_len or model.max_position_embeddings
        if max_model_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len: {max_model_len} exceeds the model's {model.max_position_embeddings}")
        self.limits = Limits(config.model_name, model.vocab_size, max_model_len, config.max_n, config.block_size,
                             config.max_logprobs)
        tokenizer = Tokenizer(config.model) if has_tokenizer(config.model) else None
        self.registry = WorkerRegistry(config, config.model_name, max_model_len)
        self.server = GrpcServer(threads=config.max_concurrent_requests + SPARE_THREADS)
        generation = GenerationServicer(config, self.limits, tokenizer, Dispatcher(self.registry, config))
        pb_grpc.add_GenerationServicer_to_server(generation, self.server.grpc)
        pb_grpc.add_RegistryServicer_to_server(RegistryServicer(self.registry, config), self.server.grpc)
        self.address = ""

    def start(self) -> str:
        self.registry.start()
        port = self.server.start(self.config.host, self.config.port, ["pdserve.v1.Generation", "pdserve.v1.Registry"])
        self.address = f"{self.config.host}:{port}"
        self.server.set_serving()
        log.info("router serving %s on %s", self.limits.model_name, self.address)
        return self.address

    def stop(self, grace: float = 2.0) -> None:
        self.server.stop(grace)
        self.registry.stop()


def run(config: RouterConfig) -> int:
    service_log.configure(config.log_level, "router")
    stop = shutdown_event()
    router = Router(config)
    try:
        announce("router", router.start(), config.address_file)
        while not stop.wait(1.0):
            pass
    finally:
        router.stop()
    return 0

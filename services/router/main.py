"""The router process: two gRPC servers, never one port for both surfaces.

    public   --host:--port                  Generation (+ health, reflection), the gRPC
                                            adapter over the front end; API keys
                                            (--api-keys-file, reloaded on SIGHUP) and
                                            TLS (--tls-cert/--tls-key) when configured
    internal --internal-host:--internal-port Registry (+ health, reflection); the
                                            cluster's credentials (mTLS and/or token)

    Router(config).start() -> public address (.internal_address: the Registry's); .stop()
    run(config)  -> serve until SIGINT/SIGTERM        (the `pdserve router` CLI)
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import grpc

from pdserve.engine.config import ModelConfig
from pdserve.engine.tokenizer import Tokenizer, has_tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common import log as service_log
from pdserve.services.common.credentials import ClusterAuth, read_secret_file
from pdserve.services.common.metrics import metrics_host, router_metrics
from pdserve.services.common.server import GrpcServer, announce, shutdown_event
from pdserve.services.router.api_keys import ApiKeys
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import Dispatcher
from pdserve.services.router.frontend import FrontEnd
from pdserve.services.router.registry import WorkerRegistry
from pdserve.services.router.registry_service import RegistryServicer
from pdserve.services.router.service import GenerationServicer
from pdserve.services.router.validate import Limits

log = logging.getLogger(__name__)
SPARE_THREADS = 16  # beyond Generate streams: health, reflection, ListModels
INTERNAL_THREADS = 16  # Register, Heartbeat, ListWorkers: short calls


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        model = ModelConfig.from_dir(config.model)
        max_model_len = config.max_model_len or model.max_position_embeddings
        if max_model_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len: {max_model_len} exceeds the model's {model.max_position_embeddings}")
        self.limits = Limits(config.model_name, model.vocab_size, max_model_len, config.max_n, config.block_size,
                             config.max_logprobs, config.max_prompt_bytes, config.max_prompt_tokens)
        tokenizer = Tokenizer(config.model) if has_tokenizer(config.model) else None
        self.auth = ClusterAuth(config.credentials)
        self.api_keys = ApiKeys(config.api_keys_file) if config.api_keys_file else None
        self.metrics = router_metrics(config.metrics, config.model_name)
        self.registry = WorkerRegistry(config, config.model_name, max_model_len, self.auth, self.metrics.kv_event)
        self.metrics.watch_workers(lambda: [h.role for h in self.registry.live()])
        public_checks = [self.api_keys.interceptor()] if self.api_keys is not None else []
        # A thread for each call in flight or in the admission queue; beyond that, calls
        # are refused at once (and gRPC's own limit bounds what waits for a thread).
        threads = config.max_concurrent_requests + config.max_queued_requests + SPARE_THREADS
        self.server = GrpcServer(threads=threads, max_concurrent_rpcs=2 * threads, interceptors=public_checks)
        dispatcher = Dispatcher(self.registry, config, self.metrics)
        self.front_end = FrontEnd(config, self.limits, tokenizer, dispatcher, self.metrics, self.api_keys)
        self.generation = GenerationServicer(self.front_end, config.stream_write_timeout, self.metrics)
        pb_grpc.add_GenerationServicer_to_server(self.generation, self.server.grpc)
        self.internal_server = GrpcServer(threads=INTERNAL_THREADS, interceptors=self.auth.interceptors())
        self.registry_service = RegistryServicer(self.registry, config)
        pb_grpc.add_RegistryServicer_to_server(self.registry_service, self.internal_server.grpc)
        self.address = ""
        self.internal_address = ""
        self.metrics_port = 0

    def start(self) -> str:
        """Serve both surfaces; returns the public address."""
        self.auth.warn_if_open("router")
        self.registry.start()
        self.metrics_port = self.registry_service.metrics_port = self.metrics.serve(
            metrics_host(self.config), self.config.metrics_port)
        port = self.server.start(self.config.host, self.config.port, ["pdserve.v1.Generation"], self._public_tls())
        self.address = f"{self.config.host}:{port}"
        internal = self.internal_server.start(self.config.registry_host, self.config.registry_port,
                                              ["pdserve.v1.Registry"], self.auth.server_credentials())
        self.internal_address = f"{self.config.registry_host}:{internal}"
        self.server.set_serving()
        self.internal_server.set_serving()
        log.info("router serving %s on %s (registry on %s)", self.limits.model_name, self.address,
                 self.internal_address)
        return self.address

    def reload_api_keys(self) -> bool:
        return self.api_keys.reload() if self.api_keys is not None else False

    def drain(self, grace: float) -> bool:
        """Stop admitting (health NOT_SERVING, new calls UNAVAILABLE); finish what is in
        flight within `grace` seconds, then fail the rest with UNAVAILABLE."""
        self.server.set_not_serving()
        return self.front_end.drain(grace)

    def stop(self, grace: float = 2.0) -> None:
        self.server.stop(grace)
        self.internal_server.stop(grace)
        self.registry.stop()
        self.generation.write_guard.close()
        self.metrics.close()

    def _public_tls(self) -> grpc.ServerCredentials | None:
        if self.config.tls_cert is None:
            return None
        key = read_secret_file(self.config.tls_key, "tls_key")
        return grpc.ssl_server_credentials([(key, Path(self.config.tls_cert).read_bytes())])


def run(config: RouterConfig) -> int:
    service_log.configure(config.log_level, "router")
    stop = shutdown_event()
    router = Router(config)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: router.reload_api_keys())
    try:
        address = router.start()
        announce("router", address, config.address_file, internal=router.internal_address)
        while not stop.wait(1.0):
            pass
        router.drain(config.drain_timeout)
    finally:
        router.stop()
    return 0

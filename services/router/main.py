"""The router process: two gRPC servers, never one port for both surfaces, and the
OpenAI-compatible HTTP API beside the public one when asked.

    public   --host:--port                  Generation (+ health, reflection), the gRPC
                                            adapter over the front end; API keys
                                            (--api-keys-file, reloaded on SIGHUP) and
                                            TLS (--tls-cert/--tls-key) when configured
    http     --http-host:--http-port        the HTTP adapter over the same front end
                                            (services/router/http/), same keys and TLS
    internal --internal-host:--internal-port Registry (+ health, reflection); the
                                            cluster's credentials (mTLS and/or token)

    Router(config).start() -> public address (.internal_address: the Registry's,
                              .http_address: the HTTP API's, "" without --http-port); .stop()
    run(config)  -> serve until SIGINT/SIGTERM        (the `pdserve router` CLI)
"""

from __future__ import annotations

import logging
import signal
from concurrent.futures import ThreadPoolExecutor
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
from pdserve.services.router.resume import Resumes
from pdserve.services.router.service import GenerationServicer
from pdserve.services.router.structured import ConstraintLimits
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
                             config.max_logprobs, config.max_prompt_bytes, config.max_prompt_tokens,
                             ConstraintLimits(config.structured_outputs_max_bytes, config.structured_outputs_max_depth))
        tokenizer = Tokenizer(config.model) if has_tokenizer(config.model) else None
        if tokenizer is not None:
            # the router encodes text prompts (and renders chats, with the HTTP API on):
            # not on the first request's time
            tokenizer.load(chat=config.http_port is not None)
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
        dispatcher = Dispatcher(self.registry, config, self.metrics, tokenizer)
        # Resume tokens are signed with the cluster token, which every router of the cluster shares.
        resumes = Resumes(self.auth.token.encode() if self.auth.token else None)
        self.front_end = FrontEnd(config, self.limits, tokenizer, dispatcher, self.metrics, self.api_keys, resumes)
        self.generation = GenerationServicer(self.front_end, config.stream_write_timeout, self.metrics)
        pb_grpc.add_GenerationServicer_to_server(self.generation, self.server.grpc)
        self.http_pool: ThreadPoolExecutor | None = None
        self.http_server = None
        if config.http_port is not None:
            from pdserve.services.router.http.app import HttpApi  # FastAPI loads only when the API is on
            from pdserve.services.router.http.server import HttpServer

            # As for gRPC: a thread for each request in flight or queued, and spares (tokenize, shutdown).
            self.http_pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http")
            template = Path(config.chat_template).read_text() if config.chat_template else None
            api = HttpApi(self.front_end, tokenizer, self.http_pool, self._healthy, template, self.api_keys,
                          config.http_max_body_bytes, self.metrics.http_request,
                          tool_call_parser=config.tool_call_parser)
            self.http_server = HttpServer(api, log_level="warning")
        self.internal_server = GrpcServer(threads=INTERNAL_THREADS, interceptors=self.auth.interceptors())
        self.registry_service = RegistryServicer(self.registry, config)
        pb_grpc.add_RegistryServicer_to_server(self.registry_service, self.internal_server.grpc)
        self.address = ""
        self.internal_address = ""
        self.http_address = ""
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
        if self.http_server is not None:
            cfg = self.config
            tls = (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
            http_port = self.http_server.start(cfg.public_http_host, cfg.http_port, tls)
            self.http_address = f"{_bracketed(cfg.public_http_host)}:{http_port}"
        self.server.set_serving()
        self.internal_server.set_serving()
        log.info("router serving %s on %s (registry on %s)", self.limits.model_name, self.address,
                 self.internal_address)
        return self.address

    def _healthy(self) -> bool:
        """The HTTP /health rule: not draining, and a worker that can decode registered
        (every decode worker also prefills: what no prefill worker takes, it does)."""
        return not self.front_end.draining and any(h.can_decode and not h.draining for h in self.registry.live())

    def reload_api_keys(self) -> bool:
        return self.api_keys.reload() if self.api_keys is not None else False

    def drain(self, grace: float) -> bool:
        """Stop admitting (health NOT_SERVING, new calls UNAVAILABLE); finish what is in
        flight within `grace` seconds, then fail the rest with UNAVAILABLE."""
        self.server.set_not_serving()
        return self.front_end.drain(grace)

    def stop(self, grace: float = 2.0) -> None:
        if self.http_server is not None:
            self.http_server.stop(grace)
        if self.http_pool is not None:
            self.http_pool.shutdown(wait=False, cancel_futures=True)
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
        announce("router", address, config.address_file, internal=router.internal_address,
                 http=router.http_address or None)
        while not stop.wait(1.0):
            pass
        router.drain(config.drain_timeout)
    finally:
        router.stop()
    return 0


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

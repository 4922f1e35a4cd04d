"""KV connectors for workers: kvtransfer's connectors behind the seam (kv_seam.py).

    --kv-connector pdserve.services.worker.kv_connectors:zmq_connector      ZeroMQ, tcp (`pdserve up`'s default)
    --kv-connector pdserve.services.worker.kv_connectors:zmq_ipc_connector  ZeroMQ, ipc (workers on one host)
    --kv-connector pdserve.services.worker.kv_connectors:gloo_connector     torch.distributed, gloo (KV on CPU)
    --kv-connector pdserve.services.worker.kv_connectors:nccl_connector     torch.distributed, NCCL (KV on GPU)

A prefill worker gets a sender, a decode worker a receiver, a mixed worker both.
Their security comes from the worker's credentials (KVCredentials: --kv-curve-cert and
--kv-curve-authorized turn CURVE on, for encrypted, authenticated ZeroMQ connections;
the cluster token signs the torch.distributed rendezvous). Settings from the
environment (every worker of a cluster sees the same):

    PDSERVE_KV_HOST      address a receiver (and its rendezvous store) binds and
                         advertises (tcp, gloo, nccl; default 127.0.0.1): a host every
                         prefill worker can reach
    PDSERVE_KV_IPC_DIR   directory of the ipc sockets (default: a new temporary directory)

How a request's transfer maps onto kvtransfer (every engine touch on the engine thread,
through `loop.call`, a poller or the engine's layer hook):

    decode  expect   -> loop.call: DecodeConnector.adopt(reservation).pack()  (the plan)
            poller   -> DecodeConnector.poll(): arrived -> loop.commit_remote,
                        failed / past deadline -> loop.fail(TRANSFER)
            cancel   -> DecodeConnector.cancel (the loop's abort hook, before the blocks
                        are freed; False while a write is landing: freed by a later poll)
    prefill start    -> loop.call: PrefillConnector.track(plan)   then the engine's layer
                        hook ships each layer's pages as soon as it is written
            finish   -> loop.call: PrefillConnector.finish (final frame, first token)
            poller   -> PrefillConnector.poll(): ack or lease -> loop.release
            cancel   -> PrefillConnector.cancel (the loop's abort hook)

The receiver's thread wakes the engine loop when a transfer ends, so a commit does not
wait for the loop's idle timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.engine import Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.connector import (
    DecodeConfig,
    DecodeConnector,
    PrefillConfig,
    PrefillConnector,
    PrefillUpdate,
)
from pdserve.kvtransfer.connector import TransferTarget as Plan
from pdserve.kvtransfer.nccl import TorchDistConfig, TorchDistReceiver, TorchDistSender
from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.kvtransfer.wire import TransferError
from pdserve.kvtransfer.zmq import ZmqConfig, ZmqReceiver, ZmqSender
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import Failure
from pdserve.services.worker.kv_seam import KVCredentials, TransferTarget

CALL_TIMEOUT = 10.0  # longest wait for the engine thread to take a command
HOST_ENV = "PDSERVE_KV_HOST"
IPC_DIR_ENV = "PDSERVE_KV_IPC_DIR"

MakeReceiver = Callable[[torch.Tensor], ZmqReceiver]  # (KV cache) -> receiver, not started
MakeSender = Callable[[], ZmqSender]


class ConnectorReceiver:
    """The seam's KVReceiver over a `DecodeConnector` and a kvtransfer receiver."""

    def __init__(self, make_receiver: MakeReceiver, on_close: Callable[[], None] = lambda: None) -> None:
        self._make_receiver = make_receiver
        self._on_close = on_close
        self.loop: EngineLoop | None = None
        self.transport: ZmqReceiver | None = None
        self.connector: DecodeConnector | None = None

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint if self.transport is not None else ""

    def bind(self, loop: EngineLoop) -> None:
        """Before the loop starts: bind the receiver into the engine's KV cache."""
        transport = self._make_receiver(loop.engine.runner.kv_cache)
        transport.start()
        transport.on_events = loop.wake
        self.loop, self.transport = loop, transport
        self.connector = DecodeConnector(loop.engine, transport, DecodeConfig(), commit=self._commit)
        loop.add_poller(self._poll)

    def expect(self, reservation: Reservation, prompt: Sequence[int], params: SamplingParams, deadline: float) -> bytes:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise TimeoutError(f"reservation {reservation.request_id!r}: its deadline has passed")
        # As the router asks the prefill worker: its first token is used unless the
        # request samples several sequences (n > 1, beams); the first token's logprobs
        # reach the client from the prefill worker.
        sample_first = params.n == 1 and not params.use_beam_search
        connector = self.connector

        def adopt(_engine) -> bytes:
            return connector.adopt(reservation, prompt, params, timeout, sample_first).pack()

        return self.loop.call(adopt, CALL_TIMEOUT)

    def cancel(self, request_id: str) -> bool | None:
        if self.connector is None:
            return None
        if self.loop.on_engine_thread:
            return self.connector.cancel(request_id)
        self.loop.abort(request_id)  # its abort hook cancels here, on the engine thread
        return None

    def stats(self) -> KVTransferStats:
        c = self.connector.stats if self.connector is not None else {}
        return KVTransferStats(c.get("bytes", 0), c.get("committed", 0), c.get("failed", 0))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self._on_close()

    # -- engine thread ------------------------------------------------------------------

    def _commit(self, request_id: str, first_token: int | None) -> list:
        self.loop.commit_remote(request_id, first_token)  # on the engine thread: now
        return []

    def _poll(self) -> None:
        update = self.connector.poll()
        for request_id, reason in update.failed.items():  # already aborted: end its stream
            self.loop.fail(request_id, Failure.TRANSFER, f"KV transfer: {reason}")


class ConnectorSender:
    """The seam's KVSender over a `PrefillConnector` and a kvtransfer sender."""

    def __init__(self, make_sender: MakeSender, endpoint: str) -> None:
        self._make_sender = make_sender
        self.endpoint = endpoint  # nothing listens here: it says "this worker ships KV"
        self.loop: EngineLoop | None = None
        self.transport: ZmqSender | None = None
        self.connector: PrefillConnector | None = None

    def bind(self, loop: EngineLoop) -> None:
        """Before the loop starts: hook the engine's layers (PrefillConnector does)."""
        self.loop, self.transport = loop, self._make_sender()
        self.connector = PrefillConnector(
            loop.engine, self.transport, PrefillConfig(lease_s=loop.held_lease), release=loop.release,
        )
        loop.add_poller(self._poll)

    def start(self, target: TransferTarget) -> None:
        plan = Plan.unpack(target.plan)  # ValueError when malformed
        prompt = list(target.prompt_token_ids)
        connector = self.connector
        self.loop.call(lambda _engine: connector.track(target.request_id, prompt, plan, target.cache_salt), CALL_TIMEOUT)

    def finish(self, request_id: str, first_token: int | None) -> None:
        connector = self.connector

        def finish(_engine) -> str | None:
            update = PrefillUpdate()
            connector.finish(request_id, first_token, update)
            if request_id in connector.exporting():  # the final message is out
                return None
            return update.released.get(request_id, "cancelled")

        why = self.loop.call(finish, CALL_TIMEOUT)
        if why is not None:
            raise TransferError(f"KV transfer of {request_id!r} failed: {why}")

    def cancel(self, request_id: str) -> None:
        if self.connector is None:
            return
        if self.loop.on_engine_thread:
            if request_id in self.connector.exporting():
                self.connector.cancel(request_id)  # tells the receiver, frees the blocks
            return
        self.loop.abort(request_id)  # its abort hook cancels here, on the engine thread

    def stats(self) -> KVTransferStats:
        c = self.connector.stats if self.connector is not None else {}
        return KVTransferStats(c.get("bytes", 0), c.get("done", 0), c.get("failed", 0))

    def close(self) -> None:
        """After the loop has stopped (the sender is the engine thread's)."""
        if self.transport is not None:
            self.transport.close()

    def _poll(self) -> None:
        self.loop.metrics.kv_sent(self.connector.poll().transfer_seconds.values())


# -- factories (`--kv-connector module:factory`) ---------------------------------------


def _zmq_config(credentials: KVCredentials) -> ZmqConfig:
    return ZmqConfig(curve=credentials.curve)


def _host() -> str:
    return os.environ.get(HOST_ENV) or "127.0.0.1"


def _sides(role: str, worker_id: str, transport: str, make_sender: MakeSender, make_receiver: MakeReceiver,
           on_close: Callable[[], None] = lambda: None) -> tuple[ConnectorSender | None, ConnectorReceiver | None]:
    if role not in ("prefill", "decode", "mixed"):
        raise ValueError(f"role: {role!r} is not prefill, decode or mixed")
    sender = ConnectorSender(make_sender, f"{transport}-sender:{worker_id}") if role != "decode" else None
    receiver = ConnectorReceiver(make_receiver, on_close) if role != "prefill" else None
    return sender, receiver


def zmq_connector(role: str, worker_id: str, credentials: KVCredentials = KVCredentials()
                  ) -> tuple[ConnectorSender | None, ConnectorReceiver | None]:
    """KV pages over ZeroMQ tcp; the receiver binds a free port on $PDSERVE_KV_HOST."""
    config = _zmq_config(credentials)
    bind = f"tcp://{_host()}:0"
    return _sides(role, worker_id, "zmq", lambda: ZmqSender(config), lambda kv: ZmqReceiver(kv, bind, config))


class _IpcSocket:
    """A receiver's ipc:// address in $PDSERVE_KV_IPC_DIR, or else in a temporary
    directory of its own (made when the receiver binds, removed when it closes)."""

    def __init__(self, worker_id: str) -> None:
        self.name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', worker_id)[:40]}-{os.getpid()}.sock"  # paths are short
        self.own_dir: str | None = None

    def address(self) -> str:
        directory = os.environ.get(IPC_DIR_ENV)
        if not directory:
            directory = self.own_dir = tempfile.mkdtemp(prefix="pdserve-kv-")
        return f"ipc://{os.path.join(directory, self.name)}"

    def cleanup(self) -> None:
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)


def zmq_ipc_connector(role: str, worker_id: str, credentials: KVCredentials = KVCredentials()
                      ) -> tuple[ConnectorSender | None, ConnectorReceiver | None]:
    """KV pages over ZeroMQ ipc (a Unix socket): prefill and decode workers on one host."""
    config = _zmq_config(credentials)
    ipc = _IpcSocket(worker_id)
    return _sides(role, worker_id, "zmq-ipc", lambda: ZmqSender(config),
                  lambda kv: ZmqReceiver(kv, ipc.address(), config), ipc.cleanup)


def _torch_connector(backend: str, role: str, worker_id: str, credentials: KVCredentials
                     ) -> tuple[ConnectorSender | None, ConnectorReceiver | None]:
    config = TorchDistConfig(backend=backend, zmq=_zmq_config(credentials), token=credentials.rendezvous_token)
    bind = f"tcp://{_host()}:0"
    return _sides(role, worker_id, backend, lambda: TorchDistSender(config),
                  lambda kv: TorchDistReceiver(kv, bind, config))


def gloo_connector(role: str, worker_id: str, credentials: KVCredentials = KVCredentials()
                   ) -> tuple[ConnectorSender | None, ConnectorReceiver | None]:
    """Headers over ZeroMQ tcp, page runs over torch.distributed gloo (CPU KV caches)."""
    return _torch_connector("gloo", role, worker_id, credentials)


def nccl_connector(role: str, worker_id: str, credentials: KVCredentials = KVCredentials()
                   ) -> tuple[ConnectorSender | None, ConnectorReceiver | None]:
    """Headers over ZeroMQ tcp, page runs over torch.distributed NCCL (CUDA KV caches)."""
    return _torch_connector("nccl", role, worker_id, credentials)

"""KV transports by name: what `--kv-connector` chooses.

    --kv-connector zmq        ZeroMQ over tcp (`pdserve up`'s default)
    --kv-connector zmq_ipc    ZeroMQ over ipc: prefill and decode workers on one host
    --kv-connector gloo       headers over ZeroMQ, pages over torch.distributed gloo (CPU KV)
    --kv-connector nccl       headers over ZeroMQ, pages over torch.distributed NCCL (CUDA KV)
    --kv-connector none       no transfer ('' too): every request is prefilled where it decodes
    --kv-connector module:factory   a plug-in: factory(TransportContext) -> Transport

A name maps to a factory here, whose transport module is imported only when it is
chosen (a ZeroMQ worker never imports torch.distributed's). The factory makes the
byte side (connector.py's Sender / Receiver) for the worker's role: a sender on a
prefill worker, a receiver on a decode worker, both on a mixed one; `open_connector`
puts the planning side over it. The old spelling
`pdserve.services.worker.kv_connectors:zmq_connector` (and `zmq_ipc_connector`,
`gloo_connector`, `nccl_connector`) still names the same transports.

Security comes from the worker's credentials (KVCredentials): CURVE keys turn on
encrypted, authenticated ZeroMQ connections; the cluster token signs the
torch.distributed rendezvous. Settings from the environment (every worker of a
cluster sees the same):

    PDSERVE_KV_HOST      address a receiver (and its rendezvous store) binds and
                         advertises (tcp, gloo, nccl; default 127.0.0.1): a host every
                         prefill worker can reach
    PDSERVE_KV_IPC_DIR   directory of the ipc sockets (default: a new temporary directory)
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.spec.draft_state import DraftLayout
from pdserve.kvtransfer.connector import KVConnector, Receiver, Sender, Transport

if TYPE_CHECKING:
    from pdserve.kvtransfer.transports.curve import CurveConfig

HOST_ENV = "PDSERVE_KV_HOST"
IPC_DIR_ENV = "PDSERVE_KV_IPC_DIR"
ROLES = ("prefill", "decode", "mixed")
NO_TRANSFER = ("", "none")


@dataclass(frozen=True)
class KVCredentials:
    """What a transport secures its transfers with (services/common/credentials.py)."""

    curve: CurveConfig | None = None  # this worker's CURVE keys (None: plaintext, development)
    rendezvous_token: bytes | None = None  # signs torch.distributed rendezvous values


@dataclass(frozen=True)
class TransportContext:
    """What a transport factory is given."""

    role: str  # prefill | decode | mixed
    worker_id: str
    kv_cache: torch.Tensor  # the engine's KV cache, where a receiver lands pages
    credentials: KVCredentials = KVCredentials()
    host: str = "127.0.0.1"  # where a receiver binds and what it advertises
    ipc_dir: str | None = None  # directory of ipc sockets (None: a temporary one)
    kv_format: str = ""  # what the KV cache's pages mean (the engine's kv_format)
    draft: DraftLayout | None = None  # the EAGLE head state a receiver takes (the engine's draft_layout)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: {self.role!r} is not prefill, decode or mixed")

    @classmethod
    def from_env(cls, role: str, worker_id: str, kv_cache: torch.Tensor, credentials: KVCredentials = KVCredentials(),
                 environ: Mapping[str, str] | None = None, kv_format: str = "",
                 draft: DraftLayout | None = None) -> "TransportContext":
        env = os.environ if environ is None else environ
        return cls(role, worker_id, kv_cache, credentials, env.get(HOST_ENV) or "127.0.0.1",
                   env.get(IPC_DIR_ENV) or None, kv_format, draft)


Factory = Callable[[TransportContext], Transport]


def _sides(ctx: TransportContext, name: str, sender: Callable[[], Sender], receiver: Callable[[], Receiver],
           cleanup: Callable[[], None] = lambda: None) -> Transport:
    return Transport(sender() if ctx.role != "decode" else None, receiver() if ctx.role != "prefill" else None,
                     f"{name}-sender:{ctx.worker_id}", cleanup)


def zmq_tcp(ctx: TransportContext) -> Transport:
    """KV pages over ZeroMQ tcp; the receiver binds a free port on the KV host."""
    from pdserve.kvtransfer.transports.zmq import ZmqConfig, ZmqReceiver, ZmqSender

    config = ZmqConfig(curve=ctx.credentials.curve)
    return _sides(ctx, "zmq", lambda: ZmqSender(config),
                  lambda: ZmqReceiver(ctx.kv_cache, f"tcp://{ctx.host}:0", config))


class _IpcSocket:
    """A receiver's ipc:// address in the context's directory, or else in a temporary
    directory of its own (made with the address, removed by `cleanup`)."""

    def __init__(self, worker_id: str, directory: str | None) -> None:
        self.name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', worker_id)[:40]}-{os.getpid()}.sock"  # paths are short
        self.directory = directory
        self.own_dir: str | None = None

    def address(self) -> str:
        directory = self.directory
        if not directory:
            directory = self.own_dir = tempfile.mkdtemp(prefix="pdserve-kv-")
        return f"ipc://{os.path.join(directory, self.name)}"

    def cleanup(self) -> None:
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)


def zmq_ipc(ctx: TransportContext) -> Transport:
    """KV pages over ZeroMQ ipc (a Unix socket): prefill and decode workers on one host."""
    from pdserve.kvtransfer.transports.zmq import ZmqConfig, ZmqReceiver, ZmqSender

    config = ZmqConfig(curve=ctx.credentials.curve)
    ipc = _IpcSocket(ctx.worker_id, ctx.ipc_dir)
    return _sides(ctx, "zmq-ipc", lambda: ZmqSender(config), lambda: ZmqReceiver(ctx.kv_cache, ipc.address(), config),
                  ipc.cleanup)


def _torch_dist(backend: str, ctx: TransportContext) -> Transport:
    from pdserve.kvtransfer.transports.nccl import TorchDistConfig, TorchDistReceiver, TorchDistSender
    from pdserve.kvtransfer.transports.zmq import ZmqConfig

    config = TorchDistConfig(backend=backend, zmq=ZmqConfig(curve=ctx.credentials.curve),
                             token=ctx.credentials.rendezvous_token)
    return _sides(ctx, backend, lambda: TorchDistSender(config),
                  lambda: TorchDistReceiver(ctx.kv_cache, f"tcp://{ctx.host}:0", config))


def gloo(ctx: TransportContext) -> Transport:
    """Headers over ZeroMQ tcp, page runs over torch.distributed gloo (CPU KV caches)."""
    return _torch_dist("gloo", ctx)


def nccl(ctx: TransportContext) -> Transport:
    """Headers over ZeroMQ tcp, page runs over torch.distributed NCCL (CUDA KV caches)."""
    return _torch_dist("nccl", ctx)


TRANSPORTS: dict[str, Factory] = {"zmq": zmq_tcp, "zmq_ipc": zmq_ipc, "gloo": gloo, "nccl": nccl}
# The spelling of the transports before they had names (launchers, charts and
# scripts written for it keep working).
_OLD_MODULE = "pdserve.services.worker.kv_connectors"
OLD_NAMES = {f"{_OLD_MODULE}:{name}_connector": name for name in TRANSPORTS}


def factory(spec: str) -> Factory | None:
    """The factory `--kv-connector spec` names; None for no transfer. Raises
    ValueError naming kv_connector when there is none such."""
    spec = OLD_NAMES.get(spec.strip(), spec.strip())
    if spec in NO_TRANSFER:
        return None
    if spec in TRANSPORTS:
        return TRANSPORTS[spec]
    module_name, colon, attr = spec.partition(":")
    if not colon:
        raise ValueError(f"kv_connector: {spec!r} is not one of {sorted(TRANSPORTS)}, 'none' or 'module:factory'")
    if not module_name or not attr:
        raise ValueError(f"kv_connector: expected 'module:factory', got {spec!r}")
    found = getattr(importlib.import_module(module_name), attr, None)
    if not callable(found):
        raise ValueError(f"kv_connector: {module_name} has no factory {attr!r}")
    return found


def open_connector(spec: str, ctx: TransportContext, vocab_size: int) -> KVConnector:
    """The worker's KV connector for `--kv-connector spec` (not started)."""
    make = factory(spec)
    return KVConnector(make(ctx) if make is not None else Transport(), ctx.kv_cache, vocab_size,
                       kv_format=ctx.kv_format, draft=ctx.draft)

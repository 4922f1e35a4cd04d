"""The seam where a KV transfer plugs into a worker (implemented by kvtransfer/).

Nothing here moves bytes. A worker with no connector configured advertises no KV
endpoint, answers Reserve and Prefill with FAILED_PRECONDITION, and the router
prefills every request on its decode worker instead: there is no fake transfer.

Prefill side (`KVSender`), per request:

    start(target)                       before the engine runs the prompt
    engine.layer_hook(layer, slices)    on the engine thread, after each layer
    finish(request_id, first_token)     prefill done; first_token None: D samples
    ... pages and the final frame reach D; then loop.release(request_id)
    cancel(request_id)                  aborted: stop (idempotent, unknown ids ignored)

Decode side (`KVReceiver`), per request:

    expect(reservation, prompt, params, deadline) -> transfer target (bytes)
                                        blocks reserved, pages may arrive; the bytes
                                        reach the sender unchanged (router-opaque)
    ... pages land in reservation.block_ids (skip num_cached_tokens' blocks)
    loop.commit_remote(request_id, first_token)   final frame arrived
    loop.fail(request_id, Failure.TRANSFER, why)  malformed / late / lost
    cancel(request_id)                  aborted or expired: stop writing its blocks
                                        (runs on the engine thread before they are
                                        freed; idempotent, unknown ids ignored).
                                        Returns False if a write into them cannot be
                                        stopped at once: the receiver then frees them
                                        itself (engine.abort from its poller) when
                                        the write is over; the loop leaves them be.

Both sides get the `EngineLoop` through `bind` and must touch the engine only via
`loop.call(...)`, `loop.add_poller(fn)` (fn runs on the engine thread every loop
iteration, e.g. to turn arrived transfers into commit_remote) or `engine.layer_hook`
(which runs on the engine thread). The EngineLoop owns `engine.step()`.
`start`, `finish` and `expect` are called from gRPC handler threads, `cancel` from
the engine thread (or a handler thread): implementations are thread-safe.
`finish` raises when the transfer has already failed (the prefill worker then fails
the Prefill RPC, and the router tries another prefill worker).

A connector is named on the command line as `--kv-connector module:factory`;
`factory(role, worker_id, credentials)` returns `(sender or None, receiver or None)`;
`credentials` (KVCredentials) are the worker's CURVE keys, with which a transport
must encrypt and authenticate whenever there are any, and the token that signs its
rendezvous, if it has one. A side may
also have `stats() -> KVTransferStats` (kvtransfer/stats.py), which the worker's Stats
RPC reports. The ZeroMQ and
torch.distributed connectors are in services/worker/kv_connectors.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.engine import Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.kvtransfer.zmq import CurveConfig
from pdserve.services.worker.engine_loop import EngineLoop


@dataclass(frozen=True)
class TransferTarget:
    """Where one request's KV goes: the decode worker's reserved blocks."""

    request_id: str
    worker_id: str
    kv_endpoint: str
    block_ids: tuple[int, ...]  # one per prompt block, in order
    num_cached_tokens: int  # D already holds these (whole blocks): do not send them
    deadline: float  # time.monotonic(); give up (and release) after it
    plan: bytes = b""  # what the receiver's `expect` returned (the connector's format)
    prompt_token_ids: tuple[int, ...] = ()  # the prompt whose KV is shipped
    cache_salt: str | None = None  # the request's: its block hashes are salted with it


@dataclass(frozen=True)
class KVCredentials:
    """What a KV connector secures its transfers with (services/common/credentials.py)."""

    curve: CurveConfig | None = None  # this worker's CURVE keys (None: plaintext, development)
    rendezvous_token: bytes | None = None  # signs torch.distributed rendezvous values


class KVSender(Protocol):
    endpoint: str  # advertised to the router; non-empty means "can ship KV"

    def bind(self, loop: EngineLoop) -> None: ...

    def start(self, target: TransferTarget) -> None: ...

    def finish(self, request_id: str, first_token: int | None) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    endpoint: str  # where senders connect; returned by Reserve

    def bind(self, loop: EngineLoop) -> None: ...

    def expect(
        self, reservation: Reservation, prompt: Sequence[int], params: SamplingParams, deadline: float
    ) -> bytes: ...

    def cancel(self, request_id: str) -> bool | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Connector:
    sender: KVSender | None = None
    receiver: KVReceiver | None = None

    @property
    def endpoint(self) -> str:
        """What the worker advertises: the receiver's endpoint, else the sender's."""
        for side in (self.receiver, self.sender):
            if side is not None and side.endpoint:
                return side.endpoint
        return ""

    def bind(self, loop: EngineLoop) -> None:
        """Hand both sides the loop; any request the loop ends early is cancelled on
        them before its blocks are freed."""
        for side in (self.sender, self.receiver):
            if side is not None:
                side.bind(loop)
                loop.add_abort_hook(side.cancel)

    def stats(self) -> KVTransferStats:
        """Transfer counters of both sides, summed (zeros without a connector)."""
        out = KVTransferStats()
        for side in (self.sender, self.receiver):
            stats = getattr(side, "stats", None)
            if callable(stats):
                out += stats()
        return out

    def close(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()


def load_connector(spec: str, role: str, worker_id: str, credentials: KVCredentials = KVCredentials()) -> Connector:
    """`""` -> no transfer; `"module:factory"` -> factory(role=, worker_id=, credentials=)."""
    if not spec:
        return Connector()
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"kv_connector: expected 'module:factory', got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr, None)
    if factory is None:
        raise ValueError(f"kv_connector: {module_name} has no {attr!r}")
    sender, receiver = factory(role=role, worker_id=worker_id, credentials=credentials)
    return Connector(sender, receiver)

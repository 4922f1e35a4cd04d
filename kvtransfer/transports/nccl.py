"""torch.distributed point-to-point transport for KV pages (NCCL on GPUs, gloo on CPUs).

The ZeroMQ control channel (kvtransfer/transports/channel.py: headers, acks, CURVE) composed with
a point-to-point page mover; the same contract as the ZeroMQ transport, only the page
bytes take another road:

    sender                                         receiver
    DEALER --hello(pair)-------------------------> ROUTER     (once per receiver)
           <-welcome(pair, store host:port, rank)-
    rank 1 ----- 2-rank process group over ------- rank 0     (rendezvous in the
                 receiver's TCPStore under "pdserve-kv/<pair>")
    DEALER --header(pages, via=p2p)--------------> ROUTER
    pg.send(run, tag k) ------------------------->  pg.recv straight into the reserved
    pg.send(run, tag k+1) ----------------------->  blocks (tags count runs per pair)
           <-ack---------------------------------

Every pair is its own process group made on demand (no global group, no
`init_process_group`): any prefill worker can pair with any decode worker at any
time, and a broken pair is dropped and made again on the next transfer. Page tensors
travel as uint8 views, so both ends agree on counts whatever the KV dtype.

The rendezvous store listens only on the receiver's KV host (never on every
interface), and with a cluster token (`TorchDistConfig.token`) both ends sign every
value they put in it and refuse every value they read that the token did not sign
(`SignedStore`): a stranger who reaches the store can stall a pairing, never steer
one to an address of its choosing. (The store itself, torch's TCPStore, has no
authentication of its own; gloo's and NCCL's data connections have none either, so
across untrusted networks the ZeroMQ transport with CURVE is the one to use.)

The receiver consumes exactly the runs a p2p header announces, even for a header it
rejects (into scratch memory), so the per-pair tag sequence stays in step.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import socket
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pdserve.kvtransfer.inbox import FrameSource, Inbox
from pdserve.kvtransfer.transfer import Export
from pdserve.kvtransfer.transports.channel import ReceiverChannel, Reply, SenderChannel, ZmqConfig
from pdserve.kvtransfer.transports.zmq import FramePageReceiver
from pdserve.kvtransfer.wire import (
    AckHeader,
    Header,
    HelloHeader,
    PageLayout,
    PagesHeader,
    TransferError,
    WelcomeHeader,
    WireError,
    encode,
)

log = logging.getLogger(__name__)
STORE_PREFIX = "pdserve-kv"
SENDER_RANK, RECEIVER_RANK = 1, 0


@dataclass(frozen=True)
class TorchDistConfig:
    backend: str = "gloo"  # "gloo" (CPU KV) or "nccl" (CUDA KV)
    # Receiver: the address its rendezvous store binds and advertises (default: the
    # host of its tcp:// endpoint; required with ipc://).
    store_host: str | None = None
    # gloo: the address this side's sockets bind (default: the store's host, which is
    # right when both workers share a machine; set it on multi-host deployments).
    local_host: str | None = None
    timeout_s: float = 30.0  # pairing, and each point-to-point operation
    max_discard_bytes: int = 1 << 30  # most a rejected header may make the receiver drain
    zmq: ZmqConfig = field(default_factory=ZmqConfig)
    # The cluster token: every rendezvous value is signed with it (None: unsigned, for
    # hand-started development only).
    token: bytes | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: {self.backend!r} is not 'gloo' or 'nccl'")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s: must be > 0")
        if self.token is not None and not self.token:
            raise ValueError("token: must not be empty")

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


def _tcp_host(endpoint: str) -> str | None:
    if not endpoint.startswith("tcp://"):
        return None
    return urlsplit(endpoint).hostname


class SignedStore(dist.Store):
    """A store whose values carry HMAC-SHA256(token, key, value): `set` signs, `get`
    refuses (RuntimeError) a value the token did not sign, or one signed for another
    key. Keys name their pair, so a value cannot be replayed into another pairing.
    Counters (`add`) stay unsigned: a stranger can disturb them, not steer a pairing.
    A store made by `clone` is kept alive by this one (C++ holds it, and a Python
    store's methods exist only while its Python object does)."""

    def __init__(self, inner: dist.Store, token: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._token = token
        self._clones: list[SignedStore] = []

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._token, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _signed(self, key: str, value: bytes) -> bytes:
        value = bytes(value)
        return self._tag(key, value) + value

    def _verified(self, key: str, raw: bytes) -> bytes:
        raw = bytes(raw)
        tag, value = raw[:32], raw[32:]
        if not hmac.compare_digest(tag, self._tag(key, value)):
            raise RuntimeError(f"rendezvous: {key!r} is not signed with the cluster token")
        return value

    def set(self, key: str, value: bytes) -> None:
        self._inner.set(key, self._signed(key, value))

    def get(self, key: str) -> bytes:
        return self._verified(key, self._inner.get(key))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        expected = bytes(expected)
        current = self._inner.compare_set(key, self._signed(key, expected) if expected else b"",
                                          self._signed(key, desired))
        return self._verified(key, current)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def clone(self) -> "SignedStore":
        clone = SignedStore(self._inner.clone(), self._token)
        self._clones.append(clone)
        return clone


def listening_store(host: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A rendezvous store (master) that listens on `host` alone, on a free port
    (TCPStore by itself listens on every interface)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address[:2])
        sock.listen(64)
        fd = sock.detach()  # the store owns it from here
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd)


def make_pair_group(
    config: TorchDistConfig, store: dist.Store, pair: str, rank: int, local_host: str
) -> tuple[dist.ProcessGroup, dist.Store]:
    """A 2-rank process group of its own, rendezvous under `pair` in `store` (values
    signed with the cluster token when there is one). Returns the group and the store
    it was made with, which the caller keeps alive as long as the group."""
    if config.token is not None:
        store = SignedStore(store, config.token)
    prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{pair}", store)
    if config.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        opts._timeout = config.timeout
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts), store
    if not dist.is_nccl_available():
        raise TransferError("backend: NCCL is not available in this torch build")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = config.timeout
    return dist.ProcessGroupNCCL(prefixed, rank, 2, opts), store


def _as_wire_tensor(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (same memory)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


class _Pair:
    """One side of a 2-rank group; built in the background on the receiver."""

    def __init__(self, pair_id: str) -> None:
        self.pair_id = pair_id
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None  # a Python store must outlive its group
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.tag = 0

    def build(self, make) -> None:
        try:
            self.group, self.store = make()
        except BaseException as exc:  # reported to whoever waits on the pair
            self.error = exc
        self.ready.set()

    def wait(self, timeout_s: float) -> dist.ProcessGroup:
        if not self.ready.wait(timeout_s) or self.group is None:
            raise TransferError(f"pair {self.pair_id}: group not formed ({self.error or 'timeout'})")
        return self.group

    def next_tag(self) -> int:
        self.tag = (self.tag + 1) % (1 << 30)
        return self.tag

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # already broken: nothing left to release
                pass


def _check_device(kv_cache: torch.Tensor, backend: str) -> None:
    expected = "cuda" if backend == "nccl" else "cpu"
    if kv_cache.device.type != expected:
        raise ValueError(f"backend: {backend} moves {expected} tensors, the KV cache is on {kv_cache.device}")


class P2PPageReceiver:
    """Page runs received by torch.distributed straight into the reserved blocks (on
    the KV tensor's device), from a pair made when its sender says hello; frame pages
    are taken as the ZeroMQ transport takes them."""

    transport = "torch"
    host_buffers = False

    def __init__(self, config: TorchDistConfig) -> None:
        self.config = config
        self.frames = FramePageReceiver()
        self._inbox: Inbox | None = None
        self._pairs: dict[bytes, _Pair] = {}
        self._store: dist.TCPStore | None = None
        self._store_host = ""

    def start(self, channel: ReceiverChannel) -> None:
        self.frames.start(channel)
        self._inbox = channel.inbox
        host = self.config.store_host or _tcp_host(channel.endpoint)
        if host is None:
            raise ValueError("store_host: required when the control endpoint is not tcp://")
        self._store_host = host
        self._store = listening_store(host, self.config.timeout)

    def stop(self) -> None:
        for pair in self._pairs.values():
            pair.close()
        self._pairs.clear()
        self._store = None

    def control(self, peer: bytes, header: Header, reply: Reply) -> None:
        if not isinstance(header, HelloHeader):
            self.frames.control(peer, header, reply)
            return
        old = self._pairs.pop(peer, None)
        if old is not None:
            old.close()
        pair = _Pair(header.pair)
        self._pairs[peer] = pair
        reply(WelcomeHeader(header.pair, self._store_host, self._store.port, SENDER_RANK))
        local = self.config.local_host or self._store_host
        make = lambda: make_pair_group(self.config, self._store, header.pair, RECEIVER_RANK, local)  # noqa: E731
        threading.Thread(target=pair.build, args=(make,), name="kv-pair", daemon=True).start()

    def take(self, h: PagesHeader, peer: bytes, src: FrameSource) -> None:
        if h.via == "frames":
            self.frames.take(h, peer, src)
        else:
            self._receive_p2p(peer, h, src.more())

    def _receive_p2p(self, peer: bytes, h: PagesHeader, has_frames: bool) -> None:
        pair = self._pairs.get(peer)
        if pair is None:
            raise WireError("not_paired", "p2p pages from a sender that never said hello")
        consumed = 0
        try:
            with self._inbox.pages(h, peer, host=False) as landings:
                if has_frames:
                    raise WireError("extra_frames", "p2p pages carry no frames")
                for landing in landings:
                    self._recv(pair, landing.tensor)
                    consumed += 1
        except WireError:
            self._discard(peer, pair, h, consumed)
            raise
        except TransferError as exc:
            self._drop(peer)
            self._inbox.fail_peer(peer, f"sender connection lost: {exc}", h.request_id)
            raise

    def _recv(self, pair: _Pair, tensor: torch.Tensor) -> None:
        group = pair.wait(self.config.timeout_s)
        try:
            group.recv([_as_wire_tensor(tensor)], SENDER_RANK, pair.next_tag()).wait(self.config.timeout)
            if tensor.device.type == "cuda":
                torch.cuda.synchronize(tensor.device)
        except TransferError:
            raise
        except Exception as exc:  # gloo/NCCL errors: peer gone, timeout
            raise TransferError(f"pair {pair.pair_id}: recv failed: {exc}") from exc

    def _discard(self, peer: bytes, pair: _Pair, h: PagesHeader, consumed: int) -> None:
        """Receive and drop the runs of a rejected header, keeping the tags in step."""
        rest = h.nbytes[consumed:]
        if sum(rest) > self.config.max_discard_bytes:
            self._drop(peer)
            return
        device = self._inbox.kv.device
        try:
            for nbytes in rest:
                self._recv(pair, torch.empty(nbytes, dtype=torch.uint8, device=device))
        except TransferError:
            self._drop(peer)

    def _drop(self, peer: bytes) -> None:
        pair = self._pairs.pop(peer, None)
        if pair is not None:
            pair.close()


class P2PPageSender:
    """Pairs with each receiver on first use (a blocking handshake of at most
    `timeout_s`, once per receiver), then sends runs with `send`, asynchronously."""

    transport = "torch"
    via = "p2p"

    def __init__(self, config: TorchDistConfig) -> None:
        self.config = config
        self._pairs: dict[str, _Pair] = {}
        self._works: deque[tuple[str, str, object]] = deque()  # (endpoint, request id, work)

    def connect(self, channel: SenderChannel, out: Export) -> None:
        if out.endpoint not in self._pairs:
            self._pairs[out.endpoint] = self._handshake(channel, out)

    def payloads(self, runs: Sequence[tuple[int, torch.Tensor]], layout: PageLayout) -> tuple[list[tuple[int, int]], list]:
        """One tensor per run, whole: `recv` writes it straight into the reserved blocks."""
        return [(first, pages.shape[0]) for first, pages in runs], [pages for _, pages in runs]

    def send(self, channel: SenderChannel, out: Export, header: bytes, tensors: list[torch.Tensor]) -> None:
        pair = self._pairs.get(out.endpoint)
        if pair is None:
            raise TransferError(f"{out.endpoint}: not paired")
        channel.send(out, [header])
        group = pair.wait(0)
        for t in tensors:
            try:
                work = group.send([_as_wire_tensor(t)], RECEIVER_RANK, pair.next_tag())
            except Exception as exc:
                self._drop(out.endpoint)
                raise TransferError(f"{out.endpoint}: p2p send failed: {exc}") from exc
            self._works.append((out.endpoint, out.request_id, work))

    def poll(self) -> list[AckHeader]:
        """A failed ack for each request whose page send failed."""
        acks = []
        while self._works and self._works[0][2].is_completed():
            endpoint, request_id, work = self._works.popleft()
            try:
                work.wait()
            except Exception as exc:  # the pair is broken: make a new one next time
                acks.append(AckHeader(request_id, False, f"p2p send failed: {exc}"))
                self._drop(endpoint)
        return acks

    def forget(self, endpoint: str) -> None:
        self._drop(endpoint)

    def close(self) -> None:
        for endpoint in list(self._pairs):
            self._drop(endpoint)

    def _drop(self, endpoint: str) -> None:
        pair = self._pairs.pop(endpoint, None)
        if pair is not None:
            pair.close()

    def _handshake(self, channel: SenderChannel, out: Export) -> _Pair:
        pair_id = uuid.uuid4().hex
        welcome = channel.exchange(out, [encode(HelloHeader(pair_id))],
                                   lambda h: isinstance(h, WelcomeHeader) and h.pair == pair_id, self.config.timeout_s)
        if welcome is None:
            channel.forget(out.endpoint)
            raise TransferError(f"{out.endpoint}: no welcome within {self.config.timeout_s} s")
        store = dist.TCPStore(welcome.host, welcome.port, None, False, timeout=self.config.timeout)
        pair = _Pair(pair_id)
        local = self.config.local_host or welcome.host
        pair.build(lambda: make_pair_group(self.config, store, pair_id, welcome.rank, local))
        if pair.error is not None:
            channel.forget(out.endpoint)
            raise TransferError(f"{out.endpoint}: pairing failed: {pair.error}") from pair.error
        return pair


class TorchDistReceiver(ReceiverChannel):
    """Decode side: the control channel with point-to-point pages (frame pages too)."""

    def __init__(self, kv_cache: torch.Tensor, bind: str, config: TorchDistConfig = TorchDistConfig()) -> None:
        _check_device(kv_cache, config.backend)
        super().__init__(kv_cache, bind, config.zmq, P2PPageReceiver(config))
        self.dist_config = config


class TorchDistSender(SenderChannel):
    """Prefill side: the control channel with point-to-point pages. Engine thread only."""

    def __init__(self, config: TorchDistConfig = TorchDistConfig()) -> None:
        super().__init__(config.zmq, P2PPageSender(config))
        self.dist_config = config

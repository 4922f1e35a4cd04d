"""The two roles of a KV transfer, driving an engine through its disaggregation API.

Decode side (`DecodeConnector`):

    reserve ──> WAITING_FOR_REMOTE_KV ──pages + final──> commit_remote (decoding)
                     │  deadline, sender abort, bad pages, cancel
                     └──────────────────────────────────> abort (blocks freed)

Prefill side (`PrefillConnector`):

    submit ──> prefill (layer hook: send layer i's new pages as soon as it is written)
           ──> finished: send final (first token) ──> held ──ack or lease──> release

Both connectors run on the engine thread: the engine is not thread-safe, and these
are the only callers that touch it. On the decode side a receiver thread writes page
bytes into reserved blocks (owned by that reservation alone until commit) and queues
done/failed events that `poll` turns into `commit_remote` / `abort`.

Invariants: every reservation ends in exactly one commit or abort, no later than its
deadline (plus a grace period if the receiver is silent); every exported request's
blocks are released on ack, on a failed ack, or when the lease runs out.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgpack
import torch

from pdserve.engine.hashing import hash_blocks  # the one block hash every worker agrees on
from pdserve.kvtransfer.wire import (
    AckHeader,
    Outgoing,
    PageLayout,
    TransferError,
    TransferEvent,
    check_secret,
    new_secret,
    prompt_digest,
)

if TYPE_CHECKING:  # the engine is driven through its public API, imported for types only
    from pdserve.engine.engine import ExportSlice, LLMEngine, Reservation
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


# -- the plan the router carries from decode to prefill ------------------------------


@dataclass(frozen=True)
class TransferTarget:
    """Where a prefill worker ships one request's KV. Made by the decode worker's
    `reserve`, carried by the router (`pack`/`unpack`: msgpack) to the prefill worker.

    `skip_blocks` leading prompt blocks are already on the decode worker (its prefix
    cache; `cached_block_hashes` are their chained hashes, which the prefill side
    checks against its own); only blocks from there on cross the wire. `block_ids`
    are the decode worker's reserved blocks, a hint that lets the sender make runs
    contiguous on both ends (the receiver never trusts them).

    `secret` is the reservation's one-time secret (wire.py): whoever holds the target
    can fill the reservation, so it travels only over the cluster's authenticated
    channels, from the decode worker through the router to the one prefill worker the
    router chose.
    """

    request_id: str
    endpoint: str
    transport: str  # "zmq" or "torch"
    layout: PageLayout
    num_tokens: int
    skip_blocks: int
    cached_block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    deadline_s: float  # how long the receiver waits, from reservation
    server_key: bytes | None = None  # the receiver's CURVE public key
    sample_first_token: bool = True  # False: the decode worker recomputes the last token
    secret: bytes = b""  # proves the sender to the receiver; required (see validate)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)

    def pack(self) -> bytes:
        return msgpack.packb({
            "rid": self.request_id, "endpoint": self.endpoint, "transport": self.transport,
            "layout": self.layout.to_wire(), "num_tokens": self.num_tokens, "skip": self.skip_blocks,
            "hashes": list(self.cached_block_hashes), "block_ids": list(self.block_ids),
            "deadline_s": self.deadline_s, "server_key": self.server_key, "sample_first": self.sample_first_token,
            "secret": self.secret,
        }, use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> "TransferTarget":
        try:
            d = msgpack.unpackb(raw, raw=False)
            target = cls(
                d["rid"], d["endpoint"], d["transport"], PageLayout.from_wire(d["layout"]), d["num_tokens"],
                d["skip"], tuple(d["hashes"]), tuple(d["block_ids"]), float(d["deadline_s"]),
                d["server_key"], d["sample_first"], d["secret"],
            )
        except Exception as exc:
            raise ValueError(f"transfer target: malformed ({exc})") from None
        target.validate()
        return target

    def validate(self) -> None:
        if not isinstance(self.request_id, str) or not isinstance(self.endpoint, str):
            raise ValueError("transfer target: request_id and endpoint must be strings")
        ints = [self.num_tokens, self.skip_blocks, *self.block_ids]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints) or self.num_tokens < 1:
            raise ValueError("transfer target: num_tokens, skip_blocks, block_ids must be ints")
        if not 0 <= self.skip_blocks < self.num_blocks or len(self.cached_block_hashes) != self.skip_blocks:
            raise ValueError(f"skip_blocks: {self.skip_blocks} with {len(self.cached_block_hashes)} hashes for {self.num_blocks} blocks")
        if self.block_ids and len(self.block_ids) != self.num_blocks:
            raise ValueError(f"block_ids: {len(self.block_ids)} ids for {self.num_blocks} blocks")
        check_secret(self.secret, "transfer target: secret")


class Receiver(Protocol):
    """What the decode connector needs from a transport (ZmqReceiver, TorchDistReceiver)."""

    endpoint: str
    server_key: bytes | None
    transport: str

    def expect(self, request_id: str, block_ids: Sequence[int], skip: int, num_tokens: int,
               digest: bytes, deadline: float, secret: bytes) -> None: ...
    def cancel(self, request_id: str, reason: str = ...) -> bool: ...
    def events(self) -> list[TransferEvent]: ...


class Sender(Protocol):
    """What the prefill connector needs from a transport (ZmqSender, TorchDistSender)."""

    transport: str

    def open(self, request_id: str, endpoint: str, server_key: bytes | None = None, *, secret: bytes) -> Outgoing: ...
    def send_pages(self, out: Outgoing, layer: int, runs: Sequence[tuple[int, torch.Tensor]], layout: PageLayout) -> int: ...
    def send_final(self, out: Outgoing, num_tokens: int, digest: bytes, first_tokens: Sequence[int]) -> None: ...
    def send_abort(self, out: Outgoing, reason: str) -> None: ...
    def poll(self, timeout_s: float = 0.0) -> list[AckHeader]: ...


def page_runs(kv: torch.Tensor, layer: int, lo: int, hi: int, src: Sequence[int],
              dst: Sequence[int] = ()) -> list[tuple[int, torch.Tensor]]:
    """Split block indices [lo, hi) into runs of blocks consecutive in `kv` (ids `src`)
    and, when the receiver's ids `dst` are known, consecutive there too. Each run is
    (first index, a view of its pages): one zero-copy frame, one straight landing.

        index   1    2    3    4          src  [.., 7, 8, 9, 3]    dst  [.., 20, 21, 30, 31]
        runs    (1, kv[l, 7:9])  (3, kv[l, 9:10])  (4, kv[l, 3:4])
    """
    runs = []
    first = lo
    for i in range(lo + 1, hi + 1):
        if i < hi and src[i] == src[i - 1] + 1 and (not dst or dst[i] == dst[i - 1] + 1):
            continue
        runs.append((first, kv[layer, src[first] : src[first] + i - first]))
        first = i
    return runs


# -- decode side -------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    timeout_s: float = 30.0  # a reservation whose KV has not fully arrived by then fails
    grace_s: float = 2.0  # backstop: abort this long after the deadline if the receiver is silent

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("decode config: timeout_s must be > 0 and grace_s >= 0")


@dataclass
class DecodeUpdate:
    """What one `poll`/`step` did: outputs of finished requests, reservations committed
    (now decoding) and reservations failed (aborted, blocks freed) with the reason."""

    outputs: list[RequestOutput] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    transfer_seconds: dict[str, float] = field(default_factory=dict)  # reserve -> commit, per committed


@dataclass
class _Waiting:
    reservation: Reservation
    started: float
    backstop: float
    sample_first_token: bool


class DecodeConnector:
    """Decode worker side: reserve blocks, let the receiver fill them, commit or abort."""

    def __init__(
        self,
        engine: LLMEngine,
        receiver: Receiver,
        config: DecodeConfig = DecodeConfig(),
        on_received: Callable[[Reservation], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        commit: Callable[[str, int | None], list[RequestOutput] | None] | None = None,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.config = config
        self.layout = PageLayout.of(engine.runner.kv_cache)
        self.on_received = on_received  # engine thread, after the pages landed, before commit
        self.clock = clock
        # How a reservation whose KV arrived starts decoding: `engine.commit_remote` by
        # default; a caller that owns the engine's loop (and its bookkeeping of
        # reservations) passes its own, which must not raise.
        self._commit_remote = commit or engine.commit_remote
        self.stats: Counter[str] = Counter()
        self._waiting: dict[str, _Waiting] = {}
        # Cancelled while a message was landing in their blocks: abort (free) them when
        # the receiver's failed event says the write is over; value: failure to report.
        self._cancelling: dict[str, str | None] = {}

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                timeout_s: float | None = None) -> TransferTarget:
        """Reserve blocks for a prompt whose KV a prefill worker will send.

        Raises NoCapacityError when the KV cache is full, ValueError on bad input.
        """
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: needs every prompt position computed here; prefill locally")
        reservation = self.engine.reserve_remote(request_id, list(prompt_token_ids), params)
        try:
            return self.adopt(reservation, prompt_token_ids, params, timeout_s)
        except Exception:
            self.engine.abort(request_id)
            raise

    def adopt(self, reservation: Reservation, prompt_token_ids: Sequence[int], params: SamplingParams,
              timeout_s: float | None = None, sample_first_token: bool | None = None) -> TransferTarget:
        """Expect the KV of a reservation the caller made itself (`engine.reserve_remote`);
        from here on this connector commits or aborts it. On error nothing is adopted
        and the reservation is still the caller's to abort.

        `sample_first_token`: whether the prefill worker's first token is used (True)
        or this worker recomputes the last prompt token and samples (False). Default:
        only for n == 1 without beams or logprobs (a caller that gets the first token's
        logprobs from the prefill worker by other means may say True for logprobs)."""
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: needs every prompt position computed here; prefill locally")
        prompt = list(prompt_token_ids)
        request_id = reservation.request_id
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout}")
        bs = self.layout.block_size
        skip = reservation.num_cached_tokens // bs
        now = self.clock()
        secret = new_secret()  # one per reservation: nothing from an earlier one proves it
        self.receiver.expect(request_id, reservation.block_ids, skip, len(prompt), prompt_digest(prompt), now + timeout,
                             secret)
        # n > 1, beams and logprobs need the decoder to sample the first token itself.
        sample_first = params.n == 1 and params.beam_width == 1 and params.logprobs is None
        if sample_first_token is not None:
            if sample_first_token and (params.n > 1 or params.beam_width > 1):
                raise ValueError("sample_first_token: n > 1 and beam search sample the first token here")
            sample_first = sample_first_token
        self._waiting[request_id] = _Waiting(reservation, now, now + timeout + self.config.grace_s, sample_first)
        self.stats["reserved"] += 1
        self.stats["cached_blocks"] += skip
        return TransferTarget(
            request_id, self.receiver.endpoint, self.receiver.transport, self.layout, len(prompt), skip,
            tuple(hash_blocks(prompt, bs, cache_salt=params.cache_salt)[:skip]), tuple(reservation.block_ids), timeout,
            self.receiver.server_key, sample_first, secret,
        )

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Abort a request wherever it is (waiting for KV or decoding); frees its blocks,
        right away (True) or, if pages are landing in them at this moment, on a later
        `poll` (False: until then nobody else may free them).

        Always cancel through here, never `engine.abort` directly, while KV may be
        arriving: the receiver must stop writing the blocks before they are freed.
        """
        self._waiting.pop(request_id, None)
        if request_id in self._cancelling:
            return False
        if self.receiver.cancel(request_id, reason):
            self.engine.abort(request_id)
            return True
        self._cancelling[request_id] = None
        return False

    def waiting(self) -> list[str]:
        """Reservations whose KV has not arrived yet (incl. those being cancelled)."""
        return [*self._waiting, *self._cancelling]

    def poll(self) -> DecodeUpdate:
        """Turn finished transfers into commits or aborts; enforce deadlines."""
        update = DecodeUpdate()
        for event in self.receiver.events():
            rid = event.request_id
            if rid in self._cancelling:  # the write in flight is over: free now
                report = self._cancelling.pop(rid)
                if report is None:
                    self.engine.abort(rid)
                else:
                    self._fail(rid, report, update)
                continue
            waiting = self._waiting.pop(rid, None)
            if waiting is None:
                continue  # cancelled meanwhile
            if event.ok:
                self._commit(waiting, event, update)
            else:
                self._fail(rid, event.reason, update)
        now = self.clock()
        for rid in [r for r, w in self._waiting.items() if now >= w.backstop]:
            del self._waiting[rid]
            reason = "deadline exceeded (receiver silent)"
            if self.receiver.cancel(rid, "deadline exceeded"):
                self._fail(rid, reason, update)
            else:
                self._cancelling[rid] = reason
        return update

    def step(self) -> DecodeUpdate:
        """`poll`, then one engine step if any request can run."""
        update = self.poll()
        stats = self.engine.stats()
        if stats.num_requests_running or stats.num_requests_waiting:
            update.outputs.extend(self.engine.step())
        return update

    def _commit(self, waiting: _Waiting, event: TransferEvent, update: DecodeUpdate) -> None:
        rid = waiting.reservation.request_id
        tokens = event.first_tokens
        vocab = self.engine.model_config.vocab_size
        if len(tokens) > 1 or any(not 0 <= t < vocab for t in tokens):
            self._fail(rid, f"first_tokens: {list(tokens)} is not one token in [0, {vocab})", update)
            return
        if self.on_received is not None:
            self.on_received(waiting.reservation)
        first = tokens[0] if tokens and waiting.sample_first_token else None
        try:
            update.outputs.extend(self._commit_remote(rid, first) or ())
        except ValueError as exc:
            self._fail(rid, f"commit: {exc}", update)
            return
        update.committed.append(rid)
        update.transfer_seconds[rid] = self.clock() - waiting.started
        self.stats["committed"] += 1
        self.stats["bytes"] += event.nbytes

    def _fail(self, request_id: str, reason: str, update: DecodeUpdate) -> None:
        self.engine.abort(request_id)
        update.failed[request_id] = reason
        self.stats["failed"] += 1
        log.info("kv transfer for %s failed: %s", request_id, reason)


# -- prefill side ------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillConfig:
    lease_s: float = 60.0  # after the final message, release held blocks by then at the latest

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError(f"lease_s: must be > 0, got {self.lease_s}")


@dataclass
class _Export:
    """One request being exported. `sent_upto[layer]` is the block index below which
    that layer's pages have been sent; `lease` is set once the final message is out."""

    target: TransferTarget
    out: Outgoing
    digest: bytes
    sent_upto: list[int]
    failed: str | None = None
    lease: float | None = None
    final_at: float | None = None  # when the final message went out


@dataclass
class PrefillUpdate:
    outputs: list[RequestOutput] = field(default_factory=list)
    released: dict[str, str] = field(default_factory=dict)  # request id -> "done" | why not
    # request id -> seconds from the final message to the receiver's ack, for "done"
    transfer_seconds: dict[str, float] = field(default_factory=dict)


class PrefillConnector:
    """Prefill worker side: stream each layer's pages the decoder lacks as soon as the
    layer is written, send the first token with the final message, release on ack."""

    def __init__(self, engine: LLMEngine, sender: Sender, config: PrefillConfig = PrefillConfig(),
                 clock: Callable[[], float] = time.monotonic,
                 release: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.sender = sender
        self.config = config
        self.clock = clock
        # How held blocks are freed once shipped (or given up): `engine.release` by
        # default; a caller that owns the engine's loop (and its leases) passes its own.
        self._release = release or engine.release
        self.kv = engine.runner.kv_cache
        self.layout = PageLayout.of(self.kv)
        self.stats: Counter[str] = Counter()
        self._exports: dict[str, _Export] = {}
        engine.layer_hook = self._on_layer

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               target: TransferTarget) -> None:
        """Prefill a prompt and stream its KV to `target` (`params`: usually max_tokens=1).

        Raises ValueError when the target does not fit this prompt or engine, and
        TransferError when the receiver cannot be reached.
        """
        self.track(request_id, prompt_token_ids, target, params.cache_salt)
        try:
            self.engine.add_request(request_id, list(prompt_token_ids), params, export_kv=True)
        except Exception:
            self._exports.pop(request_id, None)
            raise

    def track(self, request_id: str, prompt_token_ids: Sequence[int], target: TransferTarget,
              cache_salt: str | None = None) -> None:
        """Stream the KV of a request the caller adds to the engine itself, right after,
        with `export_kv=True` (and this `cache_salt`); `step`/`on_outputs` (or `finish`)
        send its final message."""
        prompt = list(prompt_token_ids)
        self._check_target(request_id, prompt, target, cache_salt)
        out = self.sender.open(request_id, target.endpoint, target.server_key, secret=target.secret)
        self._exports[request_id] = self._new_export(target, out, prompt)

    def export_held(self, request_id: str, prompt_token_ids: Sequence[int], target: TransferTarget,
                    first_tokens: Sequence[int] = (), cache_salt: str | None = None) -> None:
        """Ship the KV of a finished, held request to a target in one go (every layer,
        then the final message); the blocks stay held until acked or the lease ends.
        On TransferError the receiver is told to give up and the blocks stay held."""
        prompt = list(prompt_token_ids)
        self._check_target(request_id, prompt, target, cache_salt)
        block_ids = self.engine.held_block_ids(request_id)
        out = self.sender.open(request_id, target.endpoint, target.server_key, secret=target.secret)
        export = self._new_export(target, out, prompt)
        try:
            for layer in range(self.layout.num_layers):
                self._send_layer(export, layer, 0, len(prompt), block_ids)
        except TransferError as exc:
            self.sender.send_abort(out, f"send: {exc}")
            raise
        self._exports[request_id] = export
        self._send_final(request_id, export, list(first_tokens))

    def step(self) -> PrefillUpdate:
        """One engine step, then finish exported requests and handle acks and leases."""
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        update = self.on_outputs(outputs)
        self.poll(update)
        return update

    def on_outputs(self, outputs: list[RequestOutput]) -> PrefillUpdate:
        """Send the final message of every exported request among `outputs`."""
        update = PrefillUpdate(outputs=outputs)
        for output in outputs:
            completion = output.outputs[0] if output.outputs else None
            first = completion.token_ids[0] if completion is not None and completion.token_ids else None
            self.finish(output.request_id, first, update)
        return update

    def finish(self, request_id: str, first_token: int | None, update: PrefillUpdate | None = None) -> None:
        """An exported request's prefill is over: send the final message (with the first
        token, unless the target asked the decoder to sample it); from now on its held
        blocks wait for the ack or the lease. A request the engine aborted instead (no
        held blocks) is dropped, and the receiver told."""
        update = update if update is not None else PrefillUpdate()
        export = self._exports.get(request_id)
        if export is None or export.lease is not None:
            return
        if request_id not in self.engine.held:
            self.sender.send_abort(export.out, "prefill aborted")
            self._drop(request_id, "prefill aborted", update, release=False)
            return
        tokens = [first_token] if first_token is not None and export.target.sample_first_token else []
        self._send_final(request_id, export, tokens)
        if export.failed is not None:
            self._drop(request_id, export.failed, update)

    def poll(self, update: PrefillUpdate | None = None, timeout_s: float = 0.0) -> PrefillUpdate:
        """Release blocks the receiver confirmed (or refused), and those whose lease ended;
        waits up to `timeout_s` for an ack when none is there yet."""
        update = update or PrefillUpdate()
        for ack in self.sender.poll(timeout_s):
            export = self._exports.get(ack.request_id)
            if export is None:
                continue
            if export.lease is None:  # still prefilling: stop sending, release when it finishes
                if not ack.ok:
                    export.failed = f"receiver: {ack.reason}"
                continue
            self._drop(ack.request_id, "done" if ack.ok else f"receiver: {ack.reason}", update)
        now = self.clock()
        for rid in [r for r, e in self._exports.items() if e.lease is not None and now >= e.lease]:
            self._drop(rid, "lease expired", update)
        return update

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Stop a request's prefill and transfer; its blocks are freed."""
        export = self._exports.pop(request_id, None)
        if export is not None:
            self.sender.send_abort(export.out, reason)
        self.engine.abort(request_id)

    def exporting(self) -> list[str]:
        return list(self._exports)

    # -- internals ---------------------------------------------------------------

    def _check_target(self, request_id: str, prompt: list[int], target: TransferTarget, cache_salt: str | None) -> None:
        target.validate()
        if target.request_id != request_id:
            raise ValueError(f"target: for {target.request_id!r}, not {request_id!r}")
        if target.transport != self.sender.transport:
            raise ValueError(f"target.transport: {target.transport!r}, this sender speaks {self.sender.transport!r}")
        if target.layout != self.layout:
            raise ValueError(f"target.layout: receiver holds {target.layout}, this engine {self.layout}")
        if target.num_tokens != len(prompt):
            raise ValueError(f"target.num_tokens: {target.num_tokens} for a prompt of {len(prompt)}")
        ours = hash_blocks(prompt, self.layout.block_size, cache_salt=cache_salt)[: target.skip_blocks]
        if list(target.cached_block_hashes) != ours:
            raise ValueError("target.cached_block_hashes: do not match this prompt's blocks")

    def _new_export(self, target: TransferTarget, out: Outgoing, prompt: list[int]) -> _Export:
        return _Export(target, out, prompt_digest(prompt), [target.skip_blocks] * self.layout.num_layers)

    def _on_layer(self, layer: int, slices: list[ExportSlice]) -> None:
        """Engine hook, after `layer` wrote the K/V of each slice's tokens. Never raises."""
        for s in slices:
            export = self._exports.get(s.request_id)
            if export is None or export.failed is not None:
                continue
            try:
                self._send_layer(export, layer, s.start, s.end, s.block_ids)
            except Exception as exc:  # the forward pass must go on; the transfer fails
                export.failed = f"send: {exc}"
                self.stats["send_errors"] += 1

    def _send_layer(self, export: _Export, layer: int, start: int, end: int, block_ids: Sequence[int]) -> None:
        """Send pages [lo, hi) of `layer`: from the first block this chunk touched (or the
        first one never sent, e.g. our own prefix-cache hits), skipping what the
        receiver holds. A partially filled block is sent again with the next chunk."""
        bs = self.layout.block_size
        lo = max(export.target.skip_blocks, min(export.sent_upto[layer], start // bs))
        hi = min(-(-end // bs), export.target.num_blocks)
        if hi <= lo:
            return
        runs = page_runs(self.kv, layer, lo, hi, block_ids, export.target.block_ids)
        self.stats["bytes"] += self.sender.send_pages(export.out, layer, runs, self.layout)
        export.sent_upto[layer] = hi

    def _send_final(self, request_id: str, export: _Export, first_tokens: list[int]) -> None:
        export.final_at = self.clock()
        export.lease = export.final_at + self.config.lease_s
        if export.failed is not None:
            self.sender.send_abort(export.out, export.failed)
            return
        try:
            self.sender.send_final(export.out, export.target.num_tokens, export.digest, first_tokens)
        except TransferError as exc:
            export.failed = f"send: {exc}"
            self.sender.send_abort(export.out, export.failed)

    def _drop(self, request_id: str, why: str, update: PrefillUpdate, release: bool = True) -> None:
        export = self._exports.pop(request_id, None)
        if why == "done" and export is not None and export.final_at is not None:
            update.transfer_seconds[request_id] = self.clock() - export.final_at
        if release:
            self._release(request_id)
        update.released[request_id] = why
        self.stats["done" if why == "done" else "failed"] += 1


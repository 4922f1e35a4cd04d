"""The KV connector: one interface with two sides (the idea of vLLM v1's KVConnector).

    planning side: what the engine thread calls         byte side: what a transport is
    ---------------------------------------------        ------------------------------
    decode   DecodeConnector.expect(reservation)          Receiver: expect / cancel /
               -> Transfer (its .plan for the sender)       events / receiving
             DecodeConnector.poll() -> receiving,           (ZmqReceiver, TorchDistReceiver)
                                       arrived, failed
             DecodeConnector.cancel(transfer) -> bool
    prefill  PrefillConnector.start(id, plan) -> Export   Sender: open / send_pages /
             PrefillConnector.on_layer (engine hook)        send_final / send_abort / poll
             PrefillConnector.finish(id, first token)       (ZmqSender, TorchDistSender)
             PrefillConnector.poll() -> done, failed
             PrefillConnector.cancel(export)

A worker has one `KVConnector`: the planning side of each role it plays over one
transport (chosen by name: kvtransfer/registry.py). The planning side runs on the
engine thread only and never touches the engine: it says what arrived, what was
acknowledged and what failed, and the worker's request table
(services/worker/requests.py) decides, moves the request and frees its blocks. So
there is no deadline here: a transfer waits until its owner cancels it (expiry is
the owner's deadline), and a cancel that finds pages landing returns False, after
which a later `poll` reports the transfer failed once the write is over, and only
then may the blocks be freed.

One record per transfer (kvtransfer/transfer.py, their phases drawn there): a
decode reservation's `Transfer` (`expect` makes it, the receiver's Inbox fills it,
the worker's record holds it) and a prefill export's `Export` (`start` opens it
through the sender, whose sequence numbers it carries; the worker's record holds
it). Each side only indexes its live ones by request id: the same objects, no
copies.

On the decode side a receiver thread writes page bytes into reserved blocks (owned
by that reservation alone until it is committed or freed). On the prefill side each
layer's new pages leave as soon as the layer is written, the first token (if the
plan says so) with the final message, and the blocks stay held until the receiver's
ack.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine.hashing import hash_blocks  # the one block hash every worker agrees on
from pdserve.engine.sampling_params import continues_from_first_token
from pdserve.engine.spec.draft_state import DraftLayout, DraftState
from pdserve.kvtransfer.inbox import TransferEvent
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.kvtransfer.transfer import Export, ExportPhase, Phase, Transfer
from pdserve.kvtransfer.wire import (
    AckHeader,
    LayoutMismatch,
    PageLayout,
    TransferError,
    new_secret,
    prompt_digest,
)

if TYPE_CHECKING:  # engine types only
    from pdserve.engine.disagg import Reservation
    from pdserve.engine.export import ExportSlice
    from pdserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


# -- the byte side ------------------------------------------------------------------


class Receiver(Protocol):
    """A transport's decode end (ZmqReceiver, TorchDistReceiver)."""

    endpoint: str
    server_key: bytes | None
    transport: str
    on_events: Callable[[], None] | None  # told (on the transport's thread) when `events` has news

    def start(self) -> str: ...
    def expect(self, transfer: Transfer) -> None: ...
    def cancel(self, request_id: str, reason: str = ...) -> bool: ...
    def events(self) -> list[TransferEvent]: ...
    def receiving(self) -> list[str]: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class Sender(Protocol):
    """A transport's prefill end (ZmqSender, TorchDistSender)."""

    transport: str

    def open(self, request_id: str, endpoint: str, server_key: bytes | None = None, *, secret: bytes) -> Export: ...
    def send_pages(self, out: Export, layer: int, runs: Sequence[tuple[int, torch.Tensor]], layout: PageLayout) -> int: ...
    def send_final(self, out: Export, num_tokens: int, digest: bytes, first_tokens: Sequence[int],
                   draft: DraftState | None = None) -> None: ...
    def send_abort(self, out: Export, reason: str) -> None: ...
    def poll(self, timeout_s: float = 0.0) -> list[AckHeader]: ...
    def close(self) -> None: ...


@dataclass
class Transport:
    """One worker's byte side, as a registry factory makes it: a sender if it ships
    KV (prefill, mixed), a receiver (not started) if it takes KV (decode, mixed)."""

    sender: Sender | None = None
    receiver: Receiver | None = None
    sender_endpoint: str = ""  # what a worker that only ships advertises ("can ship KV")
    cleanup: Callable[[], None] = lambda: None  # after both are closed (e.g. an ipc directory)


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


@dataclass
class DecodeUpdate:
    """What one `poll` found, by request id: transfers whose pages began to land,
    transfers whose KV arrived whole (the first token to go on from, or None: sample
    here), and transfers that ended without it (why). A transfer cancelled while a
    write was landing is reported in `failed` once that write is over."""

    receiving: list[str] = field(default_factory=list)
    arrived: dict[str, int | None] = field(default_factory=dict)
    drafts: dict[str, DraftState] = field(default_factory=dict)  # of arrived ones: the prefill worker's head state
    failed: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # expect -> arrival, per arrived


class DecodeConnector:
    """Decode worker side: expect a reservation's KV, say when it arrived or failed."""

    def __init__(self, receiver: Receiver, kv_cache: torch.Tensor, vocab_size: int,
                 on_received: Callable[[Reservation], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, kv_format: str = "",
                 draft: DraftLayout | None = None) -> None:
        """`kv_format`: what the pages mean (the engine's kv_format); every plan
        carries it, and a prefill worker whose own differs refuses the plan. `draft`:
        the EAGLE head state this worker takes with a prompt's KV (None: none)."""
        self.receiver = receiver
        self.draft = draft
        self.layout = PageLayout.of(kv_cache, kv_format)
        self.vocab_size = vocab_size
        self.on_received = on_received  # after a transfer's pages landed, before it is reported arrived
        self.clock = clock
        self.stats: Counter[str] = Counter()
        self._live: dict[str, Transfer] = {}  # the transfers not yet reported ended (the records' own objects)

    def expect(self, reservation: Reservation, prompt_token_ids: Sequence[int], params: SamplingParams) -> Transfer:
        """The transfer that fills `reservation` (blocks the caller has reserved for this
        prompt), its `plan` for a prefill worker. The caller holds it until it is
        reported ended or its cancel returns True. Raises ValueError for a request that
        cannot take remote KV; then nothing is expected."""
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: needs every prompt position computed here; prefill locally")
        prompt = list(prompt_token_ids)
        request_id = reservation.request_id
        bs = self.layout.block_size
        skip = reservation.num_cached_tokens // bs
        secret = new_secret()  # one per reservation: nothing from an earlier one proves it
        sample_first = continues_from_first_token(params)
        plan = TransferPlan(
            request_id, self.receiver.endpoint, self.receiver.transport, self.layout, len(prompt), skip,
            _prompt_hashes(reservation.block_hashes, prompt, bs, params.cache_salt)[:skip],
            tuple(reservation.block_ids), secret, self.receiver.server_key, sample_first,
        )
        transfer = Transfer(request_id, plan.block_ids, skip, len(prompt), prompt_digest(prompt), secret,
                            self.draft, sample_first, self.clock(), reservation, plan)
        self.receiver.expect(transfer)
        self._live[request_id] = transfer
        self.stats["reserved"] += 1
        self.stats["cached_blocks"] += skip
        return transfer

    def cancel(self, transfer: Transfer, reason: str = "cancelled") -> bool:
        """Stop expecting a transfer. True: nothing writes its blocks any more; False:
        pages are landing in them right now (CANCELLING), and a later `poll` reports it
        in `failed` when they are done (until then nobody may free them). A transfer
        already reported ended: True."""
        if self._live.get(transfer.request_id) is not transfer:
            return True
        self.stats["cancelled"] += 1
        if self.receiver.cancel(transfer.request_id, reason):
            del self._live[transfer.request_id]
            return True
        return False

    def expecting(self) -> list[str]:
        """Requests whose KV is expected (including those whose cancel waits for a write)."""
        return list(self._live)

    def poll(self) -> DecodeUpdate:
        # Events first: a transfer whose end is seen here began to land before it
        # ended, so it is in `receiving` now or was in an earlier update.
        events = self.receiver.events()
        update = DecodeUpdate(receiving=[rid for rid in self.receiver.receiving() if rid in self._live])
        for event in events:
            transfer = self._live.pop(event.request_id, None)
            if transfer is None:
                continue  # cancelled while nothing was writing (the owner knows), or never ours
            if transfer.phase is Phase.CANCELLED:  # cancelled while a write landed: it is over
                update.failed[event.request_id] = event.reason or "cancelled"
            elif event.ok:
                self._arrived(transfer, event, update)
            else:
                self._failed(event.request_id, event.reason, update)
        return update

    def _arrived(self, transfer: Transfer, event: TransferEvent, update: DecodeUpdate) -> None:
        rid = event.request_id
        tokens = event.first_tokens
        if len(tokens) > 1 or any(not 0 <= t < self.vocab_size for t in tokens):
            self._failed(rid, f"first_tokens: {list(tokens)} is not one token in [0, {self.vocab_size})", update)
            return
        if self.on_received is not None:
            self.on_received(transfer.reservation)
        update.arrived[rid] = tokens[0] if tokens and transfer.sample_first_token else None
        if event.draft is not None:
            update.drafts[rid] = event.draft
        update.seconds[rid] = self.clock() - transfer.started_at
        self.stats["committed"] += 1
        self.stats["bytes"] += event.nbytes

    def _failed(self, request_id: str, reason: str, update: DecodeUpdate) -> None:
        update.failed[request_id] = reason
        self.stats["failed"] += 1
        log.info("kv transfer for %s failed: %s", request_id, reason)


# -- prefill side ------------------------------------------------------------------


@dataclass
class PrefillUpdate:
    """What one `poll` found, by request id: exports the receiver acknowledged (seconds
    from the final message to the ack) and exports that cannot complete (why)."""

    done: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class PrefillConnector:
    """Prefill worker side: stream each layer's pages the decoder lacks as soon as the
    layer is written, send the first token with the final message, report the ack.
    Each export is one `Export` (kvtransfer/transfer.py): `start` opens it, the
    worker's record holds it; this side only indexes the live ones by request id."""

    def __init__(self, sender: Sender, kv_cache: torch.Tensor, clock: Callable[[], float] = time.monotonic,
                 kv_format: str = "") -> None:
        """`kv_format`: what the pages mean (the engine's ModelRunner.kv_format); a plan
        whose layout says otherwise is refused (LayoutMismatch)."""
        self.sender = sender
        self.kv = kv_cache
        self.layout = PageLayout.of(kv_cache, kv_format)
        self.clock = clock
        self.stats: Counter[str] = Counter()
        self._exports: dict[str, Export] = {}  # not yet reported ended (the records' own objects)

    def start(self, request_id: str, prompt_token_ids: Sequence[int], plan: TransferPlan,
              cache_salt: str | None = None, block_hashes: Sequence[bytes] = ()) -> Export:
        """Ship the KV of a request the caller is about to add to the engine (with
        `export_kv` and this `cache_salt`), as `plan` says: from here on `on_layer`
        sends its pages. The caller holds the export until it is reported ended or it
        cancels it. Raises ValueError when the plan does not fit this prompt,
        LayoutMismatch (a ValueError) when the receiver's pages are not this engine's
        (dtype, shape, weights' quantization, KV scales), TransferError when the
        receiver cannot be reached. `block_hashes`: the prompt's, computed and checked
        by the caller (none: hashed here)."""
        prompt = list(prompt_token_ids)
        self._check_plan(request_id, prompt, plan, cache_salt, block_hashes)
        export = self.sender.open(request_id, plan.endpoint, plan.server_key, secret=plan.secret)
        export.plan, export.digest = plan, prompt_digest(prompt)
        export.sent_upto = [plan.skip_blocks] * self.layout.num_layers
        self._exports[request_id] = export
        return export

    def on_layer(self, layer: int, slices: list[ExportSlice]) -> None:
        """The engine's layer hook, after `layer` wrote the K/V of each slice's tokens.
        Never raises: a send that fails fails its transfer (reported by `poll`)."""
        for s in slices:
            export = self._exports.get(s.request_id)
            if export is None or export.phase is not ExportPhase.SENDING:
                continue
            try:
                self._send_layer(export, layer, s.start, s.end, s.block_ids)
            except Exception as exc:  # the forward pass must go on; the transfer fails
                export.phase, export.reason = ExportPhase.FAILED, f"send: {exc}"
                self.stats["send_errors"] += 1

    def finish(self, request_id: str, first_token: int | None, draft: DraftState | None = None) -> None:
        """The request's prefill is over (its blocks held): send the final message, with
        `first_token` if the plan uses it and the EAGLE head's `draft` state (the
        workers' kv_format says they run the same head). From now on the blocks wait for the ack
        (`poll`). Raises TransferError when the transfer has failed (the receiver is
        told, the export forgotten)."""
        export = self._exports.get(request_id)
        if export is None:
            raise TransferError(f"request_id: {request_id!r} has no KV transfer")
        tokens = [first_token] if first_token is not None and export.plan.sample_first_token else []
        if export.phase is ExportPhase.SENDING:
            try:
                self.sender.send_final(export, export.plan.num_tokens, export.digest, tokens, draft)
                export.phase, export.final_at = ExportPhase.FINAL_SENT, self.clock()
                return
            except TransferError as exc:
                export.phase, export.reason = ExportPhase.FAILED, f"send: {exc}"
        self._drop(export, ExportPhase.FAILED, export.reason, abort=True)
        raise TransferError(export.reason)

    def poll(self, timeout_s: float = 0.0) -> PrefillUpdate:
        """Acks that arrived (waiting up to `timeout_s` for one when none is there), and
        exports whose sends failed since the last call."""
        update = PrefillUpdate()
        for ack in self.sender.poll(timeout_s):
            export = self._exports.get(ack.request_id)
            if export is None:
                continue
            if ack.ok and export.phase is ExportPhase.FINAL_SENT:
                update.done[ack.request_id] = self.clock() - export.final_at
                self._drop(export, ExportPhase.ACKED)
            elif not ack.ok:
                update.failed[ack.request_id] = f"receiver: {ack.reason}"
                self._drop(export, ExportPhase.FAILED, update.failed[ack.request_id])
        for export in [e for e in self._exports.values() if e.phase is ExportPhase.FAILED]:
            update.failed[export.request_id] = export.reason
            self._drop(export, ExportPhase.FAILED, export.reason, abort=True)
        return update

    def cancel(self, export: Export, reason: str = "cancelled") -> None:
        """Forget an export (idempotent; one already reported ended is ignored). Before
        the final message the receiver is told to give up (an abort, not a failure);
        after it, the receiver has all it needs or hears the final first anyway, and the
        transfer counts as failed: it was never acknowledged (e.g. the lease ran out)."""
        if self._exports.get(export.request_id) is not export:
            return
        if export.phase is ExportPhase.FINAL_SENT:
            self._drop(export, ExportPhase.FAILED, reason)
        else:
            self._drop(export, ExportPhase.CANCELLED, reason, abort=True)

    def exporting(self) -> list[str]:
        return list(self._exports)

    # -- internals ---------------------------------------------------------------

    def _check_plan(self, request_id: str, prompt: list[int], plan: TransferPlan, cache_salt: str | None,
                    block_hashes: Sequence[bytes] = ()) -> None:
        plan.validate()
        if plan.request_id != request_id:
            raise ValueError(f"transfer_plan: for {plan.request_id!r}, not {request_id!r}")
        if request_id in self._exports:
            raise ValueError(f"request_id: {request_id!r} is already being exported")
        if plan.transport != self.sender.transport:
            raise ValueError(f"transfer_plan.transport: {plan.transport!r}, this sender speaks {self.sender.transport!r}")
        # The target's page layout is all the pages depend on; the speculative config
        # is not part of it (plan.py: the draft's KV is computed on the decode worker).
        # Pages move as stored: never send bytes the receiver would read otherwise.
        if plan.layout != self.layout:
            raise LayoutMismatch("transfer_plan.layout", plan.layout, self.layout, "decode worker", "prefill worker")
        if plan.num_tokens != len(prompt):
            raise ValueError(f"transfer_plan.num_tokens: {plan.num_tokens} for a prompt of {len(prompt)}")
        ours = _prompt_hashes(block_hashes, prompt, self.layout.block_size, cache_salt)[: plan.skip_blocks]
        if tuple(plan.cached_block_hashes) != ours:
            raise ValueError("transfer_plan.cached_block_hashes: do not match this prompt's blocks")

    def _send_layer(self, export: Export, layer: int, start: int, end: int, block_ids: Sequence[int]) -> None:
        """Send pages [lo, hi) of `layer`: from the first block this chunk touched (or the
        first one never sent, e.g. our own prefix-cache hits), skipping what the
        receiver holds. A partially filled block is sent again with the next chunk."""
        bs = self.layout.block_size
        lo = max(export.plan.skip_blocks, min(export.sent_upto[layer], start // bs))
        hi = min(-(-end // bs), export.plan.num_blocks)
        if hi <= lo:
            return
        runs = page_runs(self.kv, layer, lo, hi, block_ids, export.plan.block_ids)
        self.stats["bytes"] += self.sender.send_pages(export, layer, runs, self.layout)
        export.sent_upto[layer] = hi

    def _drop(self, export: Export, phase: ExportPhase, why: str = "", abort: bool = False) -> None:
        """End an export: forget it, tell the receiver to give up (`abort`), count it."""
        del self._exports[export.request_id]
        export.phase, export.reason = phase, why
        if abort:
            self.sender.send_abort(export, why or "cancelled")
        if phase is ExportPhase.ACKED:
            self.stats["done"] += 1
        elif phase is ExportPhase.FAILED:
            self.stats["failed"] += 1


# -- one worker's connector -----------------------------------------------------------


class KVConnector:
    """One worker's KV transfer: the planning side of each role it plays (`decode`:
    it has a receiver; `prefill`: a sender) over one transport. Built by
    kvtransfer/registry.py from `--kv-connector`; without a transport it moves nothing
    (`endpoint` ""): the worker then advertises no KV endpoint."""

    def __init__(self, transport: Transport, kv_cache: torch.Tensor, vocab_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_received: Callable[[Reservation], None] | None = None, kv_format: str = "",
                 draft: DraftLayout | None = None) -> None:
        """`kv_format`: what the engine's pages mean (LLMEngine.kv_format), part of
        the page layout both sides of a transfer must share; `draft`: the EAGLE head
        state a receiver takes (LLMEngine.draft_layout)."""
        self.transport = transport
        self.decode = None if transport.receiver is None else DecodeConnector(
            transport.receiver, kv_cache, vocab_size, on_received, clock, kv_format, draft)
        self.prefill = None if transport.sender is None else PrefillConnector(
            transport.sender, kv_cache, clock, kv_format)
        self._started = self._closed = False

    @classmethod
    def none(cls) -> "KVConnector":
        """A connector that moves nothing."""
        return cls(Transport(), torch.empty(0), 0)

    def start(self, wake: Callable[[], None] | None = None) -> None:
        """Bind the receiver, if any; `wake` is told (on its thread) when it has news."""
        receiver = self.transport.receiver
        if receiver is not None and not self._started:
            receiver.on_events = wake
            receiver.start()
        self._started = True

    @property
    def endpoint(self) -> str:
        """What the worker advertises: the receiver's endpoint, else the sender's name."""
        receiver = self.transport.receiver
        if receiver is not None:
            return receiver.endpoint if self._started else ""
        return self.transport.sender_endpoint if self.transport.sender is not None else ""

    def stats(self) -> KVTransferStats:
        """Transfer counters of both sides, summed (zeros without a transport): page
        bytes sent and received, transfers acknowledged or arrived, and failed."""
        out = KVTransferStats()
        for side, done in ((self.decode, "committed"), (self.prefill, "done")):
            if side is not None:
                out += KVTransferStats(side.stats["bytes"], side.stats[done], side.stats["failed"])
        return out

    def close(self) -> None:
        """Once the engine thread has stopped (the sender is that thread's). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.transport.receiver is not None and self._started:
            self.transport.receiver.close()
        if self.transport.sender is not None:
            self.transport.sender.close()
        self.transport.cleanup()


def _prompt_hashes(known: Sequence[bytes], prompt: list[int], block_size: int, cache_salt: str | None
                   ) -> tuple[bytes, ...]:
    """The prompt's block hashes: those its worker already computed and checked (one
    hashing per process), else computed here."""
    return tuple(known) if known else tuple(hash_blocks(prompt, block_size, cache_salt=cache_salt))

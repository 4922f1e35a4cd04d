"""One record per transfer: a decode reservation's `Transfer`, and a prefill export's
`Export`.

A decode reservation's transfer is one `Transfer`: the decode connector makes it
(`DecodeConnector.expect`), the receiver's state machine (inbox.py `Inbox`) fills it,
and the worker's request record holds it (services/worker/requests.py `Record.transfer`)
until its blocks may be freed. Nothing else keeps a copy: the connector and the inbox
index the same object by request id. Its one state field is `phase`; it has no
deadline (the record's deadline is the reservation's):

    expect ──> EXPECTED ──first proven message──> LANDING ──its write ends──> RECEIVING
                  │                                 ^  │                         │
                  │                                 └──┼──── the next message ───┤
                  │                                    │                         │ final, every page
                  │                       owner cancels│(pages landing)          v
                  │                                    v                      ARRIVED
                  │                              CANCELLING ──the write ends──> CANCELLED
                  │
                  ├── owner cancels (nothing landing) ──────────────────────> CANCELLED
                  └── unproven or out-of-order message, sender abort, lost
                      sender, pages missing at the final ─────────────────> FAILED

"Cancelled while pages are landing" is the one phase CANCELLING: the owner's cancel
returned False, the record keeps its blocks (and this transfer), and the connector
reports the transfer in `failed` once the write is over; only then are the blocks
freed. A cancel that returns True (CANCELLED at once) is never reported: the owner
already knows. A sender lost while its own write lands takes the same road (CANCELLING,
then CANCELLED when the write ends, reported as failed to an owner that never
cancelled).

Threads: the engine thread makes a Transfer and never changes its reservation fields
(request_id .. plan) afterwards. Every other
field (phase, reason, peer, next_seq, nbytes, have, missing) is the receiver's
progress: written only under the Inbox's lock, by the transport's receiver thread
(messages) or the engine thread (cancel). The engine thread reads them only after the
connector reported the transfer ended (the inbox publishes the event after its last
write, under the same lock).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.disagg import Reservation
    from pdserve.engine.spec.draft_state import DraftLayout
    from pdserve.kvtransfer.plan import TransferPlan


class Phase(enum.Enum):
    EXPECTED = "expected"  # reserved; no proven message yet
    LANDING = "landing"  # a message's pages are being written into its blocks right now
    RECEIVING = "receiving"  # pages have landed; between messages
    CANCELLING = "cancelling"  # its owner cancelled it while pages were landing: ends when the write does
    ARRIVED = "arrived"  # every page and the final message: the blocks hold the prompt's KV
    FAILED = "failed"  # ended by the receiver (reason): reported
    CANCELLED = "cancelled"  # ended by its owner's cancel

    @property
    def ended(self) -> bool:
        return self in (Phase.ARRIVED, Phase.FAILED, Phase.CANCELLED)


@dataclass(eq=False)
class Transfer:
    """One decode reservation's KV transfer (see the module docstring)."""

    request_id: str
    block_ids: tuple[int, ...]  # the reservation's blocks, by the prompt's block index
    skip: int  # leading blocks this worker already holds (never written)
    num_tokens: int
    digest: bytes  # wire.prompt_digest of the prompt: the final message must match it
    secret: bytes  # every message of the transfer proves it (wire.sign)
    draft: DraftLayout | None = None  # the EAGLE head state it takes with the final message (None: none)
    sample_first_token: bool = True  # the prefill worker's first token is used (the plan says so)
    started_at: float = 0.0  # when it was expected, on the connector's clock
    reservation: Reservation | None = None  # the engine's reservation it fills
    plan: TransferPlan | None = None  # what its sender is told (DecodeConnector.expect makes it)
    # -- the receiver's progress: under the Inbox's lock ------------------------------
    phase: Phase = Phase.EXPECTED
    reason: str = ""  # why it failed or was cancelled
    peer: bytes | None = None  # the sender it is bound to (its first accepted message's)
    next_seq: int = 0
    nbytes: int = 0  # page bytes accepted
    have: list[bytearray] = field(default_factory=list)  # have[layer][i]: page i of layer landed intact
    missing: int = 0  # zeros of `have` at indices >= skip

    @property
    def started(self) -> bool:
        """A message proving the secret has begun to land."""
        return self.phase is not Phase.EXPECTED


class ExportPhase(enum.Enum):
    SENDING = "sending"  # pages leave as the engine writes each layer
    FINAL_SENT = "final_sent"  # the final message is out: the blocks wait for the receiver's ack
    ACKED = "acked"  # the receiver has everything: the blocks may be freed
    FAILED = "failed"  # a send failed, or the receiver refused it (reason): reported
    CANCELLED = "cancelled"  # its owner gave up on it (the receiver told, before the final)

    @property
    def ended(self) -> bool:
        return self in (ExportPhase.ACKED, ExportPhase.FAILED, ExportPhase.CANCELLED)


@dataclass(eq=False)
class Export:
    """One prefill export: the sending side's only record of a transfer. The prefill
    connector opens it (`PrefillConnector.start`, through its transport's `open`), the
    transport keeps its wire counters in it (seq, nbytes), and the worker's request
    record holds it (services/worker/requests.py `Record.export`) until it ends:

        start ──> SENDING ──finish: final message out──> FINAL_SENT ──ack──> ACKED
                     │ a send fails (reported by the next poll)     │ failed ack, or
                     ├─────────────────────────────────> FAILED <───┘ unacknowledged cancel
                     └── owner cancels (the receiver is sent an abort) ──> CANCELLED

    Engine thread only (the sender, the layer hook and the connector's calls all run
    there): no lock.
    """

    request_id: str
    endpoint: str
    secret: bytes  # the reservation's secret its messages prove
    server_key: bytes | None = None
    seq: int = 0  # the next message's sequence number (the transport's)
    nbytes: int = 0  # page bytes sent (the transport's)
    plan: TransferPlan | None = None  # the decode worker's plan it follows
    digest: bytes = b""  # wire.prompt_digest of the prompt, for the final message
    sent_upto: list[int] = field(default_factory=list)  # per layer: block index below which pages are sent
    phase: ExportPhase = ExportPhase.SENDING
    reason: str = ""  # why it failed or was cancelled
    final_at: float | None = None  # when the final message went out, on the connector's clock

"""One transfer's state on the sending side.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass
class Outgoing:
    """Sender-side state of one transfer: where it goes, the reservation's secret its
    messages prove, and the next sequence number."""

    request_id: str
    endpoint: str
    secret: bytes
    server_key: bytes | None = None
    seq: int = 0
    nbytes: int = 0

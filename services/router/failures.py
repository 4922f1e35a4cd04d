"""How a worker call failed, as the router's attempts loop tells failures apart.

    WorkerFailed   the worker died or refused as another worker may not (busy: it is
                   there but full): the attempts loop tries another decode worker, or,
                   after a token reached the client, the stream migrates
    KVLost         D's KV never arrived before a token of D's own: D is fine, it
                   prefills the prompt itself
    ServeError     anything else (services/common/status.py): passed on to the client

dispatch.py classifies the gRPC errors of worker calls into these, where the
workers are called.
"""

from __future__ import annotations

GONE = "the caller went away"  # the message of a request whose caller left (nobody reads it)


class WorkerFailed(Exception):
    """A worker died or refused in a way another worker may not. `busy`: it refused
    for want of capacity (RESOURCE_EXHAUSTED), so it is there but full."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class KVLost(Exception):
    """D's reservation failed before any token of D's own: the KV transfer failed or
    its reservation expired (D's trailing metadata names a FailureKind whose
    `kv_lost` holds: TRANSFER or EXPIRED). D is fine."""

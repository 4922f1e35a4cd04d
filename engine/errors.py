"""Engine exceptions and failure kinds, which the services map to gRPC status codes
and to the proto's FailureKind (services/common/errors.py, services/common/failure.py).

Torch-free, so that the router can import them without loading the engine."""

from __future__ import annotations

import enum


class NoCapacityError(RuntimeError):
    """Not enough free KV blocks to reserve for a remote prefill right now."""


class ConstraintError(RuntimeError):
    """A request's grammar failed while decoding (the grammar engine gave up on it: a
    resource limit of a pathological grammar): the request fails alone, as
    INVALID_CONSTRAINT with the engine's reason."""


class FailureKind(enum.Enum):
    """Why a request failed, in the one vocabulary every layer shares (engine, worker,
    router; on the wire: pdserve.v1.FailureKind, mapped once in services/common/failure.py).

    The engine itself fails a request as NO_ROOM, INTERNAL, INVALID_CONSTRAINT or
    CONSTRAINT_TIMEOUT (`RequestOutput.failure`);
    the worker that owns the request's record adds the rest (aborts, deadlines, KV
    transfers, shutdown), and its RPC handlers BLOCK_HASH_MISMATCH (a request refused
    before it reached the engine)."""

    ABORTED = "aborted"  # abort() / the reader went away
    SHUTDOWN = "shutdown"  # the worker stopped (its drain grace ran out) before the request ended
    EXPIRED = "expired"  # a reservation's KV did not arrive in time
    TRANSFER = "transfer"  # the KV transfer reported an error
    INTERNAL = "internal"  # the engine raised while stepping
    NO_ROOM = "no_room"  # the request needs more KV blocks than the whole pool
    # The block hashes a request carried differ from the worker's own for its prompt
    # (engine.hashing.BlockHashMismatch): another tokenizer, block size or salt.
    BLOCK_HASH_MISMATCH = "block_hash_mismatch"
    # A request's structured-outputs constraint (engine/structured/): its grammar
    # backend refused it (a bad regex or grammar, an unsupported schema feature), or it
    # did not compile within --structured-outputs-compile-timeout. The request fails
    # alone: INVALID_ARGUMENT (HTTP 400) and DEADLINE_EXCEEDED (HTTP 504).
    INVALID_CONSTRAINT = "invalid_constraint"
    CONSTRAINT_TIMEOUT = "constraint_timeout"

    @property
    def kv_lost(self) -> bool:
        """A reservation's KV never arrived: the decode worker is fine and may prefill
        the prompt itself (the router's fallback)."""
        return self in (FailureKind.TRANSFER, FailureKind.EXPIRED)

"""Engine exceptions the services map to gRPC status codes (services/common/errors.py).

Torch-free, so that the router can import them without loading the engine."""

from __future__ import annotations


class NoCapacityError(RuntimeError):
    """Not enough free KV blocks to reserve for a remote prefill right now."""

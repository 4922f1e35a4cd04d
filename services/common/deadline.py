"""Deadlines: every wait in a service is bounded by one."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic() seconds

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(time.monotonic() + seconds)

    @classmethod
    def of_rpc(cls, context: grpc.ServicerContext, longest: float) -> "Deadline":
        """The caller's deadline, capped at `longest` seconds (also when it set none)."""
        remaining = context.time_remaining()
        if remaining is None or math.isinf(remaining):
            remaining = longest
        return cls.after(min(remaining, longest))

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def wait_step(self, step: float) -> float:
        """How long to block before looking again: `step`, or less near the deadline."""
        return min(step, self.remaining())

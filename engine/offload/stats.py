"""The tiers' counters: mutable ones the tiers bump (under their own locks), and the
frozen snapshot `EngineStats.kv_offload` carries (engine/stats.py).

    HostTier / DiskTier / Offloader --bump--> TierCounters, OffloadCounters
    LowerTiers.stats() --------------------> OffloadStats (frozen), TierStats per tier

Latency samples (offload: queued -> written; onload: a request's blocks copied up)
are kept as sum and count here; `LowerTiers.take_latency_samples()` hands each
observation over once, for a histogram.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_SAMPLES = 4096  # latency observations kept until taken (older ones are dropped)
# changed(tier, block_hash, stored): a tier's block became servable (True) or left it
# (False); how the KV event log follows the tiers (engine/kv_events.py: tier_changed)
Changed = Callable[[str, bytes, bool], None]


def unwatched(tier: str, block_hash: bytes, stored: bool) -> None:
    """No one follows this tier's changes."""


@dataclass(frozen=True)
class TierStats:
    """One lower tier at one moment; block counts are blocks of the device pool's size."""

    capacity_blocks: int = 0
    capacity_bytes: int = 0
    used_blocks: int = 0
    used_bytes: int = 0
    hits: int = 0  # blocks lookups found here (and copied up)
    misses: int = 0  # blocks lookups looked for here and did not find
    stored: int = 0  # blocks written into this tier
    evicted: int = 0  # blocks its policy dropped for room
    bytes_written: int = 0
    bytes_read: int = 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def snapshot(self, capacity_blocks: int, capacity_bytes: int, used_blocks: int, used_bytes: int) -> TierStats:
        return TierStats(capacity_blocks, capacity_bytes, used_blocks, used_bytes, self.hits, self.misses,
                         self.stored, self.evicted, self.bytes_written, self.bytes_read)


@dataclass(frozen=True)
class OffloadStats:
    """The KV hierarchy below the device pool (all zero / None with the tiers off)."""

    host: TierStats | None = None  # None: no host tier
    disk: TierStats | None = None  # None: no disk tier
    queue_depth: int = 0  # offloads waiting for the worker now
    queue_capacity: int = 0
    offloads: int = 0  # blocks copied down from the device pool
    offloads_dropped: int = 0  # the queue was full: not copied (never waited for)
    offloads_cancelled: int = 0  # the device block was reused before its copy started
    offloads_expired: int = 0  # waited past the deadline in the queue
    onloaded_blocks: int = 0  # blocks copied up into the device pool
    onload_failures: int = 0  # copies up that failed or ran past their deadline (recomputed instead)
    corrupt_files: int = 0  # disk files found truncated, corrupted or replaced (deleted, never served)
    foreign_files: int = 0  # disk files of another layout met where ours were expected (left alone)
    disk_write_errors: int = 0  # writes the disk refused (full, read-only): disk offload stopped
    disk_writes_disabled: bool = False
    offload_seconds_sum: float = 0.0
    offload_seconds_count: int = 0
    onload_seconds_sum: float = 0.0
    onload_seconds_count: int = 0


@dataclass
class OffloadCounters:
    offloads: int = 0
    offloads_dropped: int = 0
    offloads_cancelled: int = 0
    offloads_expired: int = 0
    onloaded_blocks: int = 0
    onload_failures: int = 0
    corrupt_files: int = 0
    foreign_files: int = 0
    disk_write_errors: int = 0
    offload_seconds_sum: float = 0.0
    offload_seconds_count: int = 0
    onload_seconds_sum: float = 0.0
    onload_seconds_count: int = 0
    offload_samples: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    onload_samples: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def observe_offload(self, seconds: float) -> None:
        self.offloads += 1
        self.offload_seconds_sum += seconds
        self.offload_seconds_count += 1
        self.offload_samples.append(seconds)

    def observe_onload(self, seconds: float) -> None:
        self.onload_seconds_sum += seconds
        self.onload_seconds_count += 1
        self.onload_samples.append(seconds)

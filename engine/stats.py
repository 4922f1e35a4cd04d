"""An engine's counters and gauges at one moment: what `LLMEngine.stats()` returns.

    LLMEngine.stats() -> EngineStats
        -> a worker adds what its loop knows (services/common/stats.py: WorkerStats)
        -> the Stats RPC (pb.StatsResponse), heartbeats (pb.Load), /metrics

Field names are the serving field's vocabulary and the metrics' (`num_requests_running`
is `pdserve:num_requests_running`); no one spells them as strings.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.offload.stats import OffloadStats, TierStats  # noqa: F401  (TierStats: its fields)
from pdserve.engine.spec.speculator import SpecStats
from pdserve.engine.structured.compiler import StructuredStats


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # blocks whose KV the prefix cache can hand out
    kv_cache_usage: float  # fraction of blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up, since start
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int  # since start
    num_requests_running: int
    num_requests_waiting: int
    num_requests_held: int  # prefill: finished, blocks kept until their KV is shipped
    num_held_blocks: int  # the blocks those hold
    spec_decode: SpecStats = SpecStats()  # all zero without speculative decoding
    kv_fragmentation: float = 0.0  # allocated KV slots holding no token / allocated slots, 0..1
    # The tiers below the device pool (engine/offload/stats.py): per tier (host, disk:
    # TierStats) hits, misses, bytes, usage; the offload queue, dropped / cancelled /
    # expired copies, corrupt and foreign disk files, latency sums. All zero when off.
    kv_offload: OffloadStats = OffloadStats()
    # Structured outputs (engine/structured/compiler.py): compiles and their seconds,
    # cache hits, requests per constraint kind, refusals by reason. All zero when unused.
    structured_outputs: StructuredStats = StructuredStats()

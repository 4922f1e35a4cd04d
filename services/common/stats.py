"""A worker's stats, typed from the engine to the proto and /metrics.

    LLMEngine.stats() ------------------------> EngineStats      (engine/stats.py)
    EngineLoop: + reservations, when taken ---> WorkerStats      (here)
    connector sides, summed ------------------> KVTransferStats  (kvtransfer/stats.py)
        |-- stats_response(...) --> pb.StatsResponse   the Stats RPC
        |-- load(...) ------------> pb.Load            heartbeats (the router's routing view)
        '-- WorkerMetrics.watch --> /metrics, at scrape time (services/common/metrics.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.stats import EngineStats
from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import ROLES


@dataclass(frozen=True)
class WorkerStats(EngineStats):
    """The engine's stats plus what the worker's loop knows, as of `at`."""

    num_requests_reserved: int = 0  # decode: reservations waiting for KV
    at: float = 0.0  # time.monotonic() when taken
    cached_block_hashes: tuple[bytes, ...] = ()  # only when asked for (the Stats RPC's include_block_hashes)

    @classmethod
    def of(cls, engine: EngineStats, num_requests_reserved: int, at: float,
           cached_block_hashes: tuple[bytes, ...] = ()) -> "WorkerStats":
        return cls(**vars(engine), num_requests_reserved=num_requests_reserved, at=at,
                   cached_block_hashes=cached_block_hashes)


def stats_response(worker_id: str, role: str, block_size: int, stats: WorkerStats,
                   kv: KVTransferStats = KVTransferStats()) -> pb.StatsResponse:
    spec = stats.spec_decode
    return pb.StatsResponse(
        worker_id=worker_id, role=ROLES[role], block_size=block_size,
        num_blocks=stats.num_blocks, num_free_blocks=stats.num_free_blocks, num_cached_blocks=stats.num_cached_blocks,
        prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
        num_running=stats.num_requests_running, num_waiting=stats.num_requests_waiting,
        num_held=stats.num_requests_held, num_reserved=stats.num_requests_reserved,
        num_preemptions=stats.num_preemptions, cached_block_hashes=stats.cached_block_hashes,
        kv_transfer_bytes=kv.kv_transfer_bytes, kv_transfers=kv.kv_transfers,
        kv_transfer_failures=kv.kv_transfer_failures,
        spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
        spec_decode_num_unspeculated_requests=spec.num_unspeculated_requests,
    )


def load(stats: EngineStats) -> pb.Load:
    return pb.Load(num_free_blocks=stats.num_free_blocks, num_running=stats.num_requests_running,
                   num_waiting=stats.num_requests_waiting)

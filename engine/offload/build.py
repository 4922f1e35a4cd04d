"""Building the tiers an EngineConfig asks for, around a runner's KV tensor.

    EngineConfig.kv_offload_* -> KVLayout (dtype, kv_format, model digest, block size, shape)
                              -> HostTier (host bytes // block bytes slots), DiskTier (dir, bytes)
                              -> Offloader (queue, worker) -> LowerTiers (the engine's view)

None when no tier is asked for, or when the prefix cache is off (nothing is hashed,
so nothing could be found again).
"""

from __future__ import annotations

import logging

from pdserve.engine.config import EngineConfig
from pdserve.engine.offload.copier import BlockCopier
from pdserve.engine.offload.disk import DiskTier
from pdserve.engine.offload.host import HostTier
from pdserve.engine.offload.layout import KVLayout, model_digest
from pdserve.engine.offload.offloader import Offloader
from pdserve.engine.offload.policy import make_policy
from pdserve.engine.offload.stats import OffloadCounters
from pdserve.engine.offload.tiers import LowerTiers

log = logging.getLogger(__name__)


def build_tiers(config: EngineConfig, kv_cache, kv_format: str) -> LowerTiers | None:
    """The lower tiers for an engine whose KV tensor is `kv_cache` (allocated:
    [layers, blocks, 2, block_size, kv_heads, head_dim])."""
    if not config.kv_offload:
        return None
    if not config.cache.enable_prefix_caching:
        log.warning("kv offload: the prefix cache is off, so no block could be found again: tiers off")
        return None
    shape = (kv_cache.shape[0], *kv_cache.shape[2:])
    dtype_name = str(kv_cache.dtype).removeprefix("torch.")
    layout = KVLayout(dtype_name, kv_format, model_digest(config.model), config.cache.block_size, tuple(shape))
    counters = OffloadCounters()
    host = None
    slots = config.kv_offload_host_bytes // layout.block_bytes
    if config.kv_offload_host_bytes:
        policy = make_policy(config.kv_offload_policy, slots)
        host = HostTier(slots, layout, kv_cache.dtype, policy, pin=kv_cache.device.type == "cuda")
    disk = None
    if config.kv_offload_dir is not None:
        disk_policy_name = config.kv_offload_disk_policy or config.kv_offload_policy
        probe = config.kv_offload_disk_bytes // max(1, layout.block_bytes)
        disk = DiskTier(config.kv_offload_dir, config.kv_offload_disk_bytes, layout,
                        make_policy(disk_policy_name, max(1, probe)), counters,
                        persist=config.kv_offload_persist, fsync=config.kv_offload_fsync)
    copier = BlockCopier(kv_cache)
    offloader = Offloader(copier, host, disk, counters, config.kv_offload_queue_depth, config.kv_offload_deadline,
                          tuple(shape), kv_cache.dtype)
    log.info("kv offload: host tier %d blocks (%d bytes, %s), disk tier %s; layout %s",
             slots, slots * layout.block_bytes, config.kv_offload_policy,
             f"{config.kv_offload_disk_bytes} bytes in {config.kv_offload_dir}" if disk else "off", layout.digest)
    return LowerTiers(copier, layout, host, disk, offloader, counters, config.kv_offload_onload_timeout,
                      persist=config.kv_offload_persist)

"""The KV cache as a memory hierarchy: host and disk tiers below the device pool.

    device pool  --freed cached block-->  offloader (queue, worker)  -->  host tier
        ^                                                                  |  host evicts
        |  onload at admission (prefix lookup misses the pool)             v
        +-------------------------- host tier, else disk tier  <------  disk tier

    policy.py     LRU and ARC, keyed by block hash, one per tier
    layout.py     what a block's bytes mean: KV dtype, format, model digest, shape
    host.py       preallocated block slots in host memory (pinned on a GPU host)
    blockfile.py  the disk tier's checked file format
    disk.py       one file per block, atomic writes, start-up scan, refusals
    copier.py     one block between the device pool and host memory
    offloader.py  the bounded queue and worker that copy blocks down
    tiers.py      LowerTiers: the pool's observer, onload, locate, stats, integrity
    stats.py      the counters and the frozen OffloadStats in EngineStats
    config.py     the kv_offload_* settings' checks
    build.py      the tiers an EngineConfig asks for

tiers.py's docstring draws the life of one block across the tiers.
"""

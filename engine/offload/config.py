"""The tiers' settings, checked where a user gives them (EngineConfig's kv_offload_*
fields; the worker's --kv-offload-* flags): every refusal names its flag.

    kv_offload_host_bytes    host tier's bytes (0: none); at most the machine's memory
    kv_offload_dir           disk tier's directory (None: none): a directory we may write
    kv_offload_disk_bytes    disk tier's bytes (> 0 with a directory, 0 without)
    kv_offload_persist       keep the disk tier's files across restarts (needs a directory)
    kv_offload_policy        eviction policy of both tiers: lru | arc
    kv_offload_disk_policy   the disk tier's own (None: kv_offload_policy)
    kv_offload_queue_depth   copies down waiting at most (a full queue drops)
    kv_offload_deadline      seconds a copy down may wait in the queue
    kv_offload_onload_timeout  seconds one admission may spend copying blocks up
    kv_offload_fsync         fsync each disk file (and its rename) before it counts
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pdserve.engine.offload.policy import POLICIES


def physical_memory() -> int | None:
    """The machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_offload_fields(c: Any) -> None:
    """`check_offload` on a config holding the kv_offload_* fields (EngineConfig, the
    worker's config): raise ValueError naming the flag."""
    check_offload(host_bytes=c.kv_offload_host_bytes, directory=c.kv_offload_dir,
                  disk_bytes=c.kv_offload_disk_bytes, persist=c.kv_offload_persist,
                  policy=c.kv_offload_policy, disk_policy=c.kv_offload_disk_policy,
                  queue_depth=c.kv_offload_queue_depth, deadline=c.kv_offload_deadline,
                  onload_timeout=c.kv_offload_onload_timeout)


def check_offload(*, host_bytes: int, directory: str | None, disk_bytes: int, persist: bool, policy: str,
                  disk_policy: str | None, queue_depth: int, deadline: float, onload_timeout: float) -> None:
    """Raise ValueError naming the flag for a setting the tiers cannot honour."""
    if host_bytes < 0:
        raise ValueError(f"kv_offload_host_bytes: must be >= 0, got {host_bytes}")
    memory = physical_memory()
    if memory is not None and host_bytes > memory:
        raise ValueError(f"kv_offload_host_bytes: {host_bytes} bytes is more than this machine's memory "
                         f"({memory} bytes)")
    if disk_bytes < 0:
        raise ValueError(f"kv_offload_disk_bytes: must be >= 0, got {disk_bytes}")
    for name, value in (("kv_offload_policy", policy), ("kv_offload_disk_policy", disk_policy)):
        if value is not None and value not in POLICIES:
            raise ValueError(f"{name}: unknown {value!r}; choose one of {POLICIES}")
    if queue_depth < 1:
        raise ValueError(f"kv_offload_queue_depth: must be >= 1, got {queue_depth}")
    for name, value in (("kv_offload_deadline", deadline), ("kv_offload_onload_timeout", onload_timeout)):
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")
    if directory is None:
        if disk_bytes:
            raise ValueError("kv_offload_disk_bytes: needs kv_offload_dir (the disk tier's directory)")
        if persist:
            raise ValueError("kv_offload_persist: needs kv_offload_dir (the disk tier's directory)")
        return
    if not disk_bytes:
        raise ValueError(f"kv_offload_disk_bytes: must be > 0 with kv_offload_dir {directory!r}")
    check_directory(directory)


def check_directory(directory: str) -> None:
    """A directory we can write into, or one we can create."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"kv_offload_dir: {directory!r} exists and is not a directory")
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"kv_offload_dir: {directory!r} is not writable by this process")

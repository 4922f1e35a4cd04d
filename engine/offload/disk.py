"""The disk tier: one file per block in `kv_offload_dir`, within `kv_offload_disk_bytes`.

    write(h)   temp file -> (fsync) -> rename to <layout digest>-<hash>.kvblock
               -> indexed (only now can a lookup find it) -> over budget: the policy's
               victims are deleted
    read(h)    indexed? read the whole file, check it (engine/offload/blockfile.py):
                 ok       -> the block's bytes
                 corrupt  -> deleted, counted, a miss (never served)
                 foreign  -> left alone, counted, forgotten, a miss
                 gone     -> a miss

At start the directory is scanned for this layout's files (the name's prefix is the
layout's digest; files of other models or layouts are never touched): with `persist`
they are indexed again (headers checked; oldest first into the policy), without it
they are deleted. Leftover temporary files of this layout are always deleted.

A write the disk refuses (full, read-only, gone) stops offloading to disk: one warning,
a counter, and reads go on; serving never depends on the disk. The index's lock is
never held across file I/O, except a deletion.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pdserve.engine.offload import blockfile
from pdserve.engine.offload.blockfile import CorruptBlockFile, ForeignBlockFile
from pdserve.engine.offload.layout import KVLayout
from pdserve.engine.offload.policy import EvictionPolicy
from pdserve.engine.offload.stats import Changed, OffloadCounters, TierCounters, TierStats, unwatched

log = logging.getLogger(__name__)

_HEADER_PROBE = 1 << 16  # bytes read to check a file's header at the start-up scan


@dataclass
class _File:
    token_ids: tuple[int, ...]
    size: int


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, layout: KVLayout, policy: EvictionPolicy,
                 counters: OffloadCounters, persist: bool = False, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.policy = policy
        self.shared = counters  # corrupt / foreign files, write errors
        self.counters = TierCounters()
        self.fsync = fsync
        self.writable = True
        self._index: dict[bytes, _File] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._changed: Changed = unwatched
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_offload_dir: cannot create {str(self.directory)!r}: {exc}") from None
        self._lock_file = _lock_directory(self.directory)
        self._start(persist)

    def close(self) -> None:
        """Let another engine use the directory (the lock also goes with this process)."""
        if not self._lock_file.closed:
            self._lock_file.close()

    @property
    def file_bytes(self) -> int:
        """About what one block's file takes (data, header, checksum)."""
        return self.layout.block_bytes + 256 + 8 * self.layout.block_size

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.file_bytes

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / blockfile.file_name(self.layout, block_hash)

    # -- start-up ---------------------------------------------------------------------------------

    def _start(self, persist: bool) -> None:
        prefix = self.layout.digest + "-"
        found: list[tuple[float, bytes, _File]] = []
        for path in self.directory.iterdir():
            if not path.name.startswith(prefix):
                continue  # another model's or layout's: never ours to touch
            if path.name.endswith(blockfile.TMP_SUFFIX) or not persist:
                path.unlink(missing_ok=True)
                continue
            entry = self._scan(path)
            if entry is not None:
                found.append((path.stat().st_mtime, *entry))
        for _, block_hash, entry in sorted(found, key=lambda f: f[0]):
            self._index[block_hash] = entry
            self._used += entry.size
            self.policy.insert(block_hash)
        with self._lock:
            self._evict_to(self.capacity_bytes)
        if found:
            log.info("kv offload: found %d blocks of this model on disk in %s", len(self._index), self.directory)

    def _scan(self, path: Path) -> tuple[bytes, _File] | None:
        """A file of ours found at start: its hash and tokens, if its header holds up."""
        try:
            with path.open("rb") as f:
                raw = f.read(_HEADER_PROBE)
            header, _ = blockfile.read_header(raw, self.layout)
            if path.name != blockfile.file_name(self.layout, header.block_hash):
                raise CorruptBlockFile("named for another block")
            return header.block_hash, _File(header.token_ids, path.stat().st_size)
        except ForeignBlockFile:
            self.shared.foreign_files += 1
        except CorruptBlockFile as exc:
            self._corrupt(path, str(exc))
        except OSError as exc:
            log.warning("kv offload: cannot read %s at start (%s): ignored", path, exc)
        return None

    def watch(self, changed: Changed) -> None:
        """Tell `changed(tier, hash, stored)` each block indexed here or dropped (KV
        events, engine/kv_events.py), starting with those here now (a persistent tier's)."""
        with self._lock:
            self._changed = changed
            for block_hash in self._index:
                changed(self.name, block_hash, True)

    # -- writing (the offload worker) ---------------------------------------------------------

    def contains(self, block_hash: bytes, token_ids: Sequence[int] | None = None) -> bool:
        with self._lock:
            entry = self._index.get(block_hash)
            return entry is not None and (token_ids is None or entry.token_ids == tuple(token_ids))

    def write(self, block_hash: bytes, token_ids: Sequence[int], data: memoryview) -> bool:
        """Store one block (already here: a touch). False when not stored: the disk
        refused (offload to disk then stops) or the budget cannot hold one file."""
        with self._lock:
            if block_hash in self._index:
                self.policy.touch(block_hash)
                return True
            if not self.writable:
                return False
        pieces = blockfile.encode(self.layout, block_hash, token_ids, data)
        size = sum(len(p) for p in pieces)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if not self._evict_to(self.capacity_bytes - size):
                return False
        try:
            blockfile.write_atomic(self._path(block_hash), pieces, self.fsync)
        except OSError as exc:
            self._refused(exc)
            return False
        with self._lock:
            self._index[block_hash] = _File(tuple(token_ids), size)
            self._changed(self.name, block_hash, True)
            self._used += size
            self.policy.insert(block_hash)
            self.counters.stored += 1
            self.counters.bytes_written += size
        return True

    def _refused(self, exc: OSError) -> None:
        with self._lock:
            self.shared.disk_write_errors += 1
            if self.writable:
                log.warning("kv offload: the disk refused a block (%s): offloading to %s stops; serving goes on",
                            exc, self.directory)
            self.writable = False

    def _evict_to(self, budget: int) -> bool:
        """Delete the policy's victims until at most `budget` bytes are used (lock held)."""
        while self._used > budget:
            key = self.policy.victim(lambda k: True)
            if key is None:
                return False
            self._drop(key)  # type: ignore[arg-type]
            self.policy.evicted(key)
            self.counters.evicted += 1
        return True

    def _drop(self, block_hash: bytes) -> None:
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self._changed(self.name, block_hash, False)
            self._used -= entry.size
            self._path(block_hash).unlink(missing_ok=True)

    # -- reading (the engine thread) ----------------------------------------------------------

    def read(self, block_hash: bytes, token_ids: Sequence[int]) -> memoryview | None:
        """The block's bytes (a writable view), checked; None (a miss) for anything else."""
        if not self.contains(block_hash, token_ids):
            with self._lock:
                self.counters.misses += 1
            return None
        path = self._path(block_hash)
        try:
            raw = _read_whole(path)
            data = blockfile.decode(raw, self.layout, block_hash, token_ids)
        except ForeignBlockFile:  # replaced by another layout's file: not ours to delete
            with self._lock:
                self.shared.foreign_files += 1
                self._forget(block_hash)
            return None
        except CorruptBlockFile as exc:
            with self._lock:
                self._forget(block_hash)
            self._corrupt(path, str(exc))
            return None
        except OSError:  # gone (evicted meanwhile, or deleted by hand)
            with self._lock:
                self._forget(block_hash)
            return None
        with self._lock:
            self.policy.touch(block_hash)
            self.counters.hits += 1
            self.counters.bytes_read += len(raw)
        return data

    def count_miss(self) -> None:
        """A lookup that did not look here found nothing anywhere: a miss here too."""
        with self._lock:
            self.counters.misses += 1

    def _forget(self, block_hash: bytes) -> None:
        """Out of the index and the policy; the file is left where it is (lock held)."""
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self._changed(self.name, block_hash, False)
            self._used -= entry.size
        self.policy.remove(block_hash)
        self.counters.misses += 1

    def _corrupt(self, path: Path, why: str) -> None:
        log.warning("kv offload: %s is corrupt (%s): deleted, recomputed instead", path.name, why)
        with self._lock:
            self.shared.corrupt_files += 1
        path.unlink(missing_ok=True)

    # -- accounting -----------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            return self.counters.snapshot(self.capacity_blocks, self.capacity_bytes, len(self._index), self._used)

    def check_integrity(self) -> None:
        """The index, the policy and the used bytes agree, and every indexed file exists."""
        with self._lock:
            if len(self.policy) != len(self._index) or any(h not in self.policy for h in self._index):
                raise RuntimeError("disk tier: the eviction policy and the index disagree")
            if self._used != sum(e.size for e in self._index.values()):
                raise RuntimeError("disk tier: used bytes do not add up")
            if self._used > self.capacity_bytes:
                raise RuntimeError(f"disk tier: {self._used} bytes used of {self.capacity_bytes}")
            missing = [h for h in self._index if not self._path(h).is_file()]
            if missing:
                raise RuntimeError(f"disk tier: {len(missing)} indexed blocks have no file")


def _read_whole(path: Path) -> bytearray:
    """A file's bytes in a writable buffer (torch.frombuffer takes it without a copy)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        got = f.readinto(buf)
    return buf if got == size else buf[:got]


LOCK_NAME = ".pdserve-kv-offload.lock"


def _lock_directory(directory: Path) -> TextIO:
    """An exclusive lock on `directory`, held while the tier lives (the kernel drops it
    when the process dies, so a killed worker's restart gets it back). Two live
    workers sharing a directory would delete or evict each other's files (a tier
    without --kv-offload-persist clears its layout's files at start; each budgets the
    directory as its own): the second is refused at start."""
    f = open(directory / LOCK_NAME, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"kv_offload_dir: {str(directory)!r} is in use by another running worker ({holder}); "
                         "give each worker a directory of its own") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f

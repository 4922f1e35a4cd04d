"""The offloader (engine/offload/offloader.py): a bounded queue that drops instead of
waiting, a deadline, and no device block overwritten while it is copied out."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from pdserve.engine.offload.copier import BlockCopier
from pdserve.engine.offload.disk import DiskTier
from pdserve.engine.offload.host import HostTier
from pdserve.engine.offload.offloader import Offloader
from pdserve.engine.offload.policy import make_policy
from pdserve.engine.offload.stats import OffloadCounters
from offload_helpers import LAYOUT, SHAPE, block_data, block_hash, tokens


class GatedCopier(BlockCopier):
    """A copier whose copies down wait for `gate` (a slow device, a busy bus)."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        super().__init__(kv_cache)
        self.gate = threading.Event()
        self.started = threading.Event()

    def to_host(self, block_id: int, dst: torch.Tensor, ready=None) -> None:
        self.started.set()
        assert self.gate.wait(10)
        super().to_host(block_id, dst, ready)


def device(num_blocks: int = 8) -> torch.Tensor:
    """A KV tensor [layers, blocks, 2, block_size, heads, dim] whose block i holds block_data(i)."""
    kv = torch.zeros((SHAPE[0], num_blocks, *SHAPE[1:]))
    for i in range(num_blocks):
        kv[:, i] = block_data(i)
    return kv


def offloader(copier, host=True, disk: DiskTier | None = None, depth: int = 4, deadline: float = 10.0,
              counters: OffloadCounters | None = None, clock=time.monotonic):
    counters = counters or OffloadCounters()
    tier = HostTier(4, LAYOUT, torch.float32, make_policy("lru", 4)) if host else None
    return Offloader(copier, tier, disk, counters, depth, deadline, SHAPE, torch.float32, clock), tier, counters


def test_blocks_are_copied_down_by_the_worker() -> None:
    off, host, counters = offloader(BlockCopier(device()))
    for i in range(3):
        assert off.submit(i, block_hash(i), tokens(i))
    assert off.flush(10)
    for i in range(3):
        slot = host.acquire(block_hash(i), tokens(i))
        assert torch.equal(host.store[slot], block_data(i))
        host.release(block_hash(i))
    assert counters.offloads == 3 and counters.offload_seconds_count == 3
    assert not off.submit(0, block_hash(0), tokens(0))  # already in the host tier: not copied again
    host.check_integrity()
    off.close()


def test_a_full_queue_drops_and_never_waits() -> None:
    copier = GatedCopier(device())
    off, host, counters = offloader(copier, depth=2)
    assert off.submit(0, block_hash(0), tokens(0))
    assert copier.started.wait(10)  # the worker holds block 0; the queue is empty again
    started = time.monotonic()
    results = [off.submit(i, block_hash(i), tokens(i)) for i in range(1, 6)]
    assert time.monotonic() - started < 1.0  # never waited for the worker
    assert results == [True, True, False, False, False]
    assert counters.offloads_dropped == 3 and off.queue_depth == 2
    copier.gate.set()
    assert off.flush(10)
    assert counters.offloads == 3
    host.check_integrity()
    off.close()


def test_copies_past_the_deadline_expire() -> None:
    now = [0.0]
    copier = GatedCopier(device())
    off, host, counters = offloader(copier, deadline=5.0, clock=lambda: now[0])
    off.submit(0, block_hash(0), tokens(0))
    assert copier.started.wait(10)
    off.submit(1, block_hash(1), tokens(1))
    now[0] = 6.0  # block 1 waited past the deadline
    copier.gate.set()
    assert off.flush(10)
    assert counters.offloads_expired == 1 and counters.offloads == 1
    assert host.contains(block_hash(0)) and not host.contains(block_hash(1))
    off.close()


def test_reusing_a_block_cancels_its_queued_copy() -> None:
    copier = GatedCopier(device())
    off, host, counters = offloader(copier)
    off.submit(0, block_hash(0), tokens(0))
    assert copier.started.wait(10)
    off.submit(1, block_hash(1), tokens(1))
    off.cancel(1)  # the pool reuses block 1 before its copy started
    copier.gate.set()
    assert off.flush(10)
    assert counters.offloads_cancelled == 1 and not host.contains(block_hash(1))
    off.close()


def test_reusing_a_block_waits_for_the_copy_in_flight() -> None:
    """The pool may not overwrite a block the worker is reading: cancel() returns only
    once that copy is done, and the tier holds the block's old bytes."""
    kv = device()
    copier = GatedCopier(kv)
    off, host, _ = offloader(copier)
    off.submit(3, block_hash(3), tokens(3))
    assert copier.started.wait(10)
    done = threading.Event()

    def reuse() -> None:
        off.cancel(3)
        kv[:, 3] = -1.0  # the new owner writes
        done.set()

    t = threading.Thread(target=reuse)
    t.start()
    assert not done.wait(0.3)  # still copying: the reuse waits
    copier.gate.set()
    assert done.wait(10)
    t.join(10)
    off.flush(10)
    slot = host.acquire(block_hash(3), tokens(3))
    assert torch.equal(host.store[slot], block_data(3))
    host.release(block_hash(3))
    off.close()


def test_without_a_host_tier_blocks_go_straight_to_disk(tmp_path: Path) -> None:
    counters = OffloadCounters()
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT, make_policy("lru", 64), counters)
    off, _, _ = offloader(BlockCopier(device()), host=False, disk=disk, counters=counters)
    off.submit(2, block_hash(2), tokens(2))
    assert off.flush(10)
    data = disk.read(block_hash(2), tokens(2))
    assert torch.equal(torch.frombuffer(data, dtype=torch.float32).reshape(SHAPE), block_data(2))
    disk.check_integrity()
    off.close()


def test_host_victims_are_demoted_to_disk(tmp_path: Path) -> None:
    counters = OffloadCounters()
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT, make_policy("lru", 64), counters)
    off, host, _ = offloader(BlockCopier(device()), disk=disk, counters=counters)
    for i in range(6):  # 4 host slots: blocks 0 and 1 go down to disk
        off.submit(i, block_hash(i), tokens(i))
        assert off.flush(10)
    assert [host.contains(block_hash(i)) for i in range(6)] == [False, False, True, True, True, True]
    for i in (0, 1):
        data = disk.read(block_hash(i), tokens(i))
        assert torch.equal(torch.frombuffer(data, dtype=torch.float32).reshape(SHAPE), block_data(i))
    host.check_integrity()
    disk.check_integrity()
    off.close()


def test_a_failing_copy_costs_the_block_not_the_worker() -> None:
    class Broken(BlockCopier):
        def to_host(self, block_id, dst, ready=None):
            if block_id == 0:
                raise RuntimeError("bus error")
            super().to_host(block_id, dst, ready)

    off, host, _ = offloader(Broken(device()))
    off.submit(0, block_hash(0), tokens(0))
    off.submit(1, block_hash(1), tokens(1))
    assert off.flush(10)
    assert not host.contains(block_hash(0)) and host.contains(block_hash(1))
    host.check_integrity()
    off.close()

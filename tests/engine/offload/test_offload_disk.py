"""The disk tier (engine/offload/disk.py) and its file format (blockfile.py): atomic
files, checks on read, foreign files left alone, refusals, persistence."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.offload import blockfile
from pdserve.engine.offload.disk import DiskTier
from pdserve.engine.offload.policy import make_policy
from pdserve.engine.offload.stats import OffloadCounters
from offload_helpers import LAYOUT, OTHER_LAYOUT, as_view, block_data, block_hash, tokens

BIG = 1 << 20


def tier(path: Path, capacity: int = BIG, persist: bool = False, layout=LAYOUT, policy: str = "lru",
         fsync: bool = False) -> DiskTier:
    return DiskTier(path, capacity, layout, make_policy(policy, 64), OffloadCounters(), persist=persist, fsync=fsync)


def put(t: DiskTier, i: int) -> bool:
    return t.write(block_hash(i), tokens(i), as_view(block_data(i)))


def read(t: DiskTier, i: int, toks=None):
    data = t.read(block_hash(i), tokens(i) if toks is None else toks)
    return None if data is None else torch.frombuffer(data, dtype=torch.float32).reshape(block_data(i).shape)


def path_of(t: DiskTier, i: int) -> Path:
    return t.directory / blockfile.file_name(t.layout, block_hash(i))


@pytest.mark.parametrize("fsync", [False, True])
def test_round_trip(tmp_path: Path, fsync: bool) -> None:
    t = tier(tmp_path, fsync=fsync)
    assert put(t, 1)
    assert torch.equal(read(t, 1), block_data(1))
    assert read(t, 1, toks=tokens(2)) is None  # another block's tokens under this hash: a miss
    assert not list(tmp_path.glob("*" + blockfile.TMP_SUFFIX))  # written atomically: no temporary left
    t.check_integrity()
    s = t.stats()
    assert (s.hits, s.misses, s.stored, s.used_blocks) == (1, 1, 1, 1)


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate", "flip a header byte", "append", "garbage"])
def test_a_damaged_file_is_detected_deleted_and_never_served(tmp_path: Path, damage: str) -> None:
    t = tier(tmp_path)
    put(t, 1)
    path = path_of(t, 1)
    raw = bytearray(path.read_bytes())
    if damage == "flip a data byte":
        raw[-100] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip a header byte":
        raw[20] ^= 0x01
    elif damage == "append":
        raw += b"\0"
    else:
        raw = bytearray(os.urandom(len(raw)))
    path.write_bytes(bytes(raw))
    assert read(t, 1) is None
    assert not path.exists()
    assert t.shared.corrupt_files == 1
    t.check_integrity()
    assert put(t, 1) and torch.equal(read(t, 1), block_data(1))  # written again, served again


def test_a_file_replaced_by_another_blocks_is_corrupt(tmp_path: Path) -> None:
    t = tier(tmp_path)
    put(t, 1)
    put(t, 2)
    os.replace(path_of(t, 2), path_of(t, 1))  # block 1's name now holds block 2
    assert read(t, 1) is None
    assert t.shared.corrupt_files == 1 and not path_of(t, 1).exists()
    assert read(t, 2) is None  # block 2's file was moved away: a miss, and forgotten
    t.check_integrity()


def test_a_file_replaced_by_another_layouts_is_left_alone(tmp_path: Path) -> None:
    t = tier(tmp_path)
    other = tier(tmp_path / "other", layout=OTHER_LAYOUT)
    put(t, 1)
    put(other, 1)
    os.replace(path_of(other, 1), path_of(t, 1))  # another model's block under our name
    assert read(t, 1) is None
    assert t.shared.foreign_files == 1 and t.shared.corrupt_files == 0
    assert path_of(t, 1).exists()  # not ours to delete
    t.check_integrity()


def test_another_models_files_are_ignored_at_start_and_never_deleted(tmp_path: Path) -> None:
    other = tier(tmp_path, layout=OTHER_LAYOUT)
    put(other, 1)
    other.close()  # a worker of another model used the directory before
    stranger = tmp_path / "notes.txt"
    stranger.write_text("not a block")
    for persist in (False, True):
        t = tier(tmp_path, persist=persist)
        assert read(t, 1) is None
        assert path_of(other, 1).exists() and stranger.exists()
        assert t.stats().used_blocks == 0
        t.close()


@pytest.mark.parametrize("layout", [LAYOUT, OTHER_LAYOUT])
def test_a_directory_in_use_by_a_live_tier_is_refused_naming_the_flag(tmp_path: Path, layout) -> None:
    first = tier(tmp_path)
    put(first, 1)
    with pytest.raises(ValueError, match=r"kv_offload_dir: .* in use by another running worker \(pid \d+\)"):
        tier(tmp_path, layout=layout, persist=True)
    assert torch.equal(read(first, 1), block_data(1))  # the refused one touched nothing
    first.close()
    again = tier(tmp_path, persist=True)  # free once the first let go
    assert torch.equal(read(again, 1), block_data(1))


def test_a_worker_killed_while_writing_leaves_only_whole_blocks(tmp_path: Path) -> None:
    """SIGKILL a process that writes blocks as fast as it can: its lock dies with it, a
    new tier gets the directory, serves only whole, checked blocks, and no temporary."""
    code = (
        "import sys, itertools\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_offload_disk import tier, put\n"
        "t = tier(__import__('pathlib').Path(sys.argv[1]), capacity=1 << 30, persist=True)\n"
        "for i in itertools.count():\n"
        "    put(t, i % 5000)\n"
        "    if i == 20: print('writing', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(Path(__file__).parent)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline().strip() == "writing", "the writer did not start within 120 s"
        time.sleep(0.3)
    finally:
        child.kill()
        child.wait(10)
    t = tier(tmp_path, capacity=1 << 30, persist=True)
    found = t.stats().used_blocks
    assert found > 20
    served = [i for i in range(5000) if (data := read(t, i)) is not None and torch.equal(data, block_data(i))]
    assert len(served) == found and t.shared.corrupt_files <= 1  # at most the file being renamed over
    assert not list(tmp_path.glob("*" + blockfile.TMP_SUFFIX))
    t.check_integrity()


def test_persist_finds_blocks_again_and_without_it_they_are_removed(tmp_path: Path) -> None:
    t = tier(tmp_path)
    for i in range(3):
        put(t, i)
    t.close()
    (tmp_path / (LAYOUT.digest + "-dead" + blockfile.TMP_SUFFIX)).write_bytes(b"half")  # a crash mid-write
    again = tier(tmp_path, persist=True)
    assert again.stats().used_blocks == 3
    assert all(torch.equal(read(again, i), block_data(i)) for i in range(3))
    assert not list(tmp_path.glob("*" + blockfile.TMP_SUFFIX))
    again.check_integrity()
    again.close()
    fresh = tier(tmp_path, persist=False)
    assert fresh.stats().used_blocks == 0 and not list(tmp_path.glob(LAYOUT.digest + "-*"))


def test_persist_scan_deletes_our_corrupt_files(tmp_path: Path) -> None:
    t = tier(tmp_path)
    put(t, 1)
    put(t, 2)
    path_of(t, 1).write_bytes(b"PDSKVBLK garbage")
    t.close()
    again = tier(tmp_path, persist=True)
    assert again.shared.corrupt_files == 1 and not path_of(t, 1).exists()
    assert again.stats().used_blocks == 1 and read(again, 2) is not None


def test_budget_evicts_old_files(tmp_path: Path) -> None:
    one = sum(len(p) for p in blockfile.encode(LAYOUT, block_hash(0), tokens(0), as_view(block_data(0))))
    t = tier(tmp_path, capacity=3 * one)
    for i in range(5):
        assert put(t, i)
    assert t.stats().used_blocks == 3 and t.stats().evicted == 2
    assert read(t, 0) is None and not path_of(t, 0).exists()
    assert read(t, 4) is not None
    t.check_integrity()


def test_a_budget_below_one_block_stores_nothing(tmp_path: Path) -> None:
    t = tier(tmp_path, capacity=100)
    assert not put(t, 1)
    assert t.writable and t.stats().used_blocks == 0


def test_disk_full_stops_offload_with_one_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    t = tier(tmp_path)
    put(t, 1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(blockfile, "write_atomic", full)
    with caplog.at_level("WARNING"):
        assert not put(t, 2)
        assert not put(t, 3)
    assert not t.writable and t.shared.disk_write_errors == 1
    assert len([r for r in caplog.records if "refused" in r.message]) == 1
    assert read(t, 1) is not None  # reads go on
    t.check_integrity()


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[str]:
    """`directory` made read-only under a live tier, as a user can (chmod) or, as root,
    whom permissions do not bind, as a disk remounted read-only after errors does (a
    tmpfs mounted there is remounted ro: EROFS), else as an immutable directory (EPERM).
    Yields how."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        try:
            yield "chmod"
        finally:
            os.chmod(directory, 0o755)
        return
    if subprocess.run(["mount", "-o", "remount,ro", str(directory)], capture_output=True).returncode == 0:
        try:
            yield "remounted read-only"
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(directory)], capture_output=True)
        return
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0:
        try:
            yield "immutable"
        finally:
            subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
        return
    pytest.skip("running as root where neither a read-only remount nor chattr +i is allowed")


@pytest.fixture
def own_mount(tmp_path: Path) -> Iterator[Path]:
    """A directory that is a tmpfs of its own where root may mount one (so that it can be
    remounted read-only), else a plain one."""
    directory = tmp_path / "tier"
    directory.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(directory)], capture_output=True).returncode == 0
    try:
        yield directory
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def test_a_directory_turned_read_only_stops_offload_and_serving_goes_on(own_mount: Path, caplog) -> None:
    t = tier(own_mount)
    assert put(t, 1)
    with read_only(own_mount) as how, caplog.at_level("WARNING"):
        assert not put(t, 2), how
        assert not put(t, 3), how
        assert not t.writable and t.shared.disk_write_errors == 1, how
        assert len([r for r in caplog.records if "refused" in r.message]) == 1
        assert torch.equal(read(t, 1), block_data(1))  # reads go on
        assert read(t, 2) is None
    t.check_integrity()
    t.close()


def test_a_file_deleted_behind_the_tiers_back_is_a_miss(tmp_path: Path) -> None:
    t = tier(tmp_path)
    put(t, 1)
    path_of(t, 1).unlink()
    assert read(t, 1) is None and t.shared.corrupt_files == 0
    t.check_integrity()

"""The CPUs a process may use (services/common/cpus.py): its affinity capped by its
cgroup's CPU limit, read from cgroup v2 and v1 files laid out as the kernel does."""

from __future__ import annotations

import os

import pytest

from pdserve.services.common.cpus import cgroup_cpu_limit, format_cpus, this_process
from pdserve.services.node import torch_threads


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("text, limit", [("max 100000\n", None), ("250000 100000\n", 2.5), ("100000 100000", 1.0),
                                         ("50000 100000", 0.5), ("garbage", None), ("0 100000", None)])
def test_cgroup_v2_cpu_max(tmp_path, text, limit):
    write(tmp_path / "cpu.max", text)
    assert cgroup_cpu_limit(tmp_path, own="/") == limit


def test_cgroup_v2_reads_the_process_own_cgroup_first(tmp_path):
    write(tmp_path / "cpu.max", "max 100000")
    write(tmp_path / "system.slice" / "pd.service" / "cpu.max", "300000 100000")
    assert cgroup_cpu_limit(tmp_path, own="/system.slice/pd.service") == 3.0
    assert cgroup_cpu_limit(tmp_path, own="/elsewhere") is None  # not there: the root's file


@pytest.mark.parametrize("quota, period, limit", [("-1", "100000", None), ("400000", "100000", 4.0)])
def test_cgroup_v1_cfs_quota(tmp_path, quota, period, limit):
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", quota)
    write(tmp_path / "cpu" / "cpu.cfs_period_us", period)
    assert cgroup_cpu_limit(tmp_path, own="/") == limit


def test_no_cgroup_files_is_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path, own="/") is None


def test_usable_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path):
    affinity = sorted(os.sched_getaffinity(0))
    assert this_process(tmp_path).ids == tuple(affinity)
    assert this_process(tmp_path).usable == len(affinity)
    write(tmp_path / "cpu.max", "50000 100000")  # half a CPU still runs one thread
    capped = this_process(tmp_path)
    assert capped.usable == 1 and capped.quota == 0.5 and "cgroup CPU limit 0.5" in capped.describe()


@pytest.mark.parametrize("ids, text", [((0,), "0"), ((0, 1, 2, 3), "0-3"), ((3, 0, 1, 8, 10, 11), "0-1,3,8,10-11"),
                                       ((), "")])
def test_format_cpus_is_the_form_the_flags_take(ids, text):
    assert format_cpus(ids) == text


def test_a_worker_takes_its_flag_else_one_thread_per_usable_cpu():
    assert torch_threads(3) == (3, "--torch-threads")
    assert torch_threads(0)[0] == 0
    threads, why = torch_threads(None)
    assert threads == this_process().usable and why.startswith("one per usable CPU")

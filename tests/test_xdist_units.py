"""tests/xdist_units.py's scheduling (tests/xdist_units.py) under pytest-xdist: the files marked `timed` are one
unit of work, every other file a unit of its own, and the workers take the timed unit
first, then the in-process files, then the `cluster` files longest first."""

from __future__ import annotations

from pathlib import Path

import pytest

import xdist_units

REPO_TESTS = Path(xdist_units.__file__).parent


def test_the_timed_files_are_read_from_their_marker():
    assert xdist_units.marked_timed(REPO_TESTS / "cluster" / "test_load.py")
    assert xdist_units.marked_timed(REPO_TESTS / "launch" / "test_ray_launcher.py")
    assert not xdist_units.marked_timed(REPO_TESTS / "cluster" / "test_cluster.py")  # cluster(seconds=...)
    assert not xdist_units.marked_timed(REPO_TESTS / "engine" / "test_block_pool.py")  # no marker


def test_the_timed_files_are_one_unit_and_every_other_file_its_own():
    root, seen = REPO_TESTS.parent, {}
    assert xdist_units.unit_of("tests/cluster/test_load.py", root, seen) == "timed"
    assert xdist_units.unit_of("tests/cluster/test_chaos.py", root, seen) == "timed"
    assert xdist_units.unit_of("tests/launch/test_ray_launcher.py", root, seen) == "timed"
    assert xdist_units.unit_of("tests/cluster/test_cluster.py", root, seen) == "tests/cluster/test_cluster.py"
    assert seen["tests/cluster/test_load.py"] and not seen["tests/cluster/test_cluster.py"]


def test_the_units_go_out_timed_then_in_process_then_clusters_longest_first():
    class Item:
        def __init__(self, *marks) -> None:
            self.marks = {m.name: m for m in marks}

        def get_closest_marker(self, name):
            return self.marks.get(name)

    plain, timed = Item(), Item(pytest.mark.timed.mark)
    short, long = Item(pytest.mark.cluster(seconds=5).mark), Item(pytest.mark.cluster(seconds=120).mark)
    assert sorted([short, plain, long, timed], key=xdist_units.rank) == [timed, plain, long, short]

import os

import pytest

# Triton runs on a CPU only in interpreter mode, and the variable must be set
# before triton is first imported anywhere in the test session.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread for torch in this process and in every child it starts (bench
# runs; workers set theirs with --torch-threads, 1 by default): the test models are
# tiny, and OpenMP threads spinning beside the cluster processes a test starts (or
# beside another pytest-xdist worker) made the engine tests several times slower.
# Read by torch when it is first imported, so set here, before any test module.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Under pytest-xdist (`make test`: `-n 2 --dist loadfile`), each test file is one unit of
# work, so that a module's cluster starts once. Two markers order the units (pyproject.toml
# registers them); the files say what they are, nothing here lists them:
#   1. `timed` (times asserted under load: the load and chaos tests, the Ray launcher's
#      drains and restarts, which race the clock on a loaded machine): all of them one
#      unit, handed out first, so they run one after the other on one worker;
#   2. meanwhile, on the other, the files marked neither, which compute in this one
#      process, so that the timed tests share a core only with single-threaded work;
#   3. then the files marked `cluster(seconds=N)`, which start processes, longest first
#      (N: about what the file takes in `make test`, --durations), so that the workers
#      finish together. Two of those side by side slow each other past their share of
#      the cores (Ray's most), hence this order.
# Plain `pytest` runs keep the files in their order.
TIMED_UNIT = "timed"


def _rank(item: pytest.Item) -> tuple[int, float]:
    if item.get_closest_marker("timed") is not None:
        return (0, 0.0)
    cluster = item.get_closest_marker("cluster")
    if cluster is None:
        return (1, 0.0)
    return (2, -float(cluster.kwargs.get("seconds", 0)))


def pytest_collection_modifyitems(config, items) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        # The controller schedules by node id alone, so the unit's name rides on the id
        # (as pytest-xdist's own --dist loadgroup does with xdist_group).
        if item.get_closest_marker("timed") is not None:
            item._nodeid = f"{item.nodeid}@{TIMED_UNIT}"
    items.sort(key=_rank)  # the order the controller hands the units out in; stable: each file keeps its order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, known only where it is installed
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the `timed` tests as one unit."""
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.endswith(f"@{TIMED_UNIT}"):
                return TIMED_UNIT
            return super()._split_scope(nodeid)

    if config.getvalue("dist") == "loadfile":
        return Scheduling(config, log)
    return None

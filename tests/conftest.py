import os

import pytest

from xdist_units import rank, unit_of  # tests/ is on sys.path for its conftest

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
# Plain `pytest` runs keep the files in their order (tests/xdist_units.py).


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order the controller hands the units out in
        items.sort(key=rank)  # stable: each file keeps its order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, known only where it is installed
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files marked `timed` as one unit."""
    from xdist.scheduler import LoadFileScheduling

    root = config.rootpath

    class Scheduling(LoadFileScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self.timed: dict[str, bool] = {}  # a test file's path -> whether it is marked timed

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(super()._split_scope(nodeid), root, self.timed)

    if config.getvalue("dist") == "loadfile":
        return Scheduling(config, log)
    return None

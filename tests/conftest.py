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

# Under pytest-xdist (`make test`: `-n 2 --dist loadfile`), each file is one unit of
# work, so that a module's cluster starts once, and the units go out in this order:
#   1. the timed files (load, chaos: times asserted under load; the Ray launcher's,
#      whose drains and restarts race the clock on a loaded machine), one unit, so
#      one after the other on one worker;
#   2. meanwhile, on the other, the files that compute in this one process (and at
#      most one child at a time), so that the timed tests keep a core to themselves
#      and share the other only with single-threaded work;
#   3. then the files that start clusters of processes, longest first (--durations),
#      so that the workers finish together. Two of those side by side slow each
#      other past their share of the cores (Ray's most), hence this order.
# Plain `pytest` runs keep the files in their order.
TIMED = ("test_load.py", "test_chaos.py", "test_ray_launcher.py")
ONE_CHILD_AT_A_TIME = (  # after the in-process files: single-threaded, but a process beside it
    "test_worker_kv_transfer.py",
    "test_backpressure.py",
    "test_bench_offline.py",
    "test_bench_sampled.py",
    "test_bench_spec.py",
    "test_worker_kv_fp8.py",
    "test_packaging.py",
)
CLUSTERS_LONGEST_FIRST = (
    "test_bench_comparisons.py",
    "test_faults.py",
    "test_rolling_restart.py",
    "test_cluster_pd.py",
    "test_cluster_quant.py",
    "test_bench_quant.py",
    "test_cluster.py",
    "test_cluster_migration.py",
    "test_http_errors.py",
    "test_security.py",
    "test_router_replicas.py",
    "test_observability.py",
    "test_bench_serving.py",
    "test_poison_pill.py",
    "test_routers.py",
    "test_plan.py",
    "test_openai_clients.py",
    "test_http_disconnect.py",
    "test_http_hostile.py",
    "test_openai_without_chat_template.py",
)


def _xdist_rank(name: str) -> int:
    if name in TIMED:
        return 0
    if name in CLUSTERS_LONGEST_FIRST:
        return 3 + CLUSTERS_LONGEST_FIRST.index(name)
    return 2 if name in ONE_CHILD_AT_A_TIME else 1


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order the controller hands the files out in
        items.sort(key=lambda item: _xdist_rank(item.path.name))  # stable: each file keeps its order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, known only where it is installed
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the TIMED files as one unit (the controller sees node ids only)."""
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "timed" if path.rpartition("/")[2] in TIMED else path

    if config.getvalue("dist") == "loadfile":
        return Scheduling(config, log)
    return None

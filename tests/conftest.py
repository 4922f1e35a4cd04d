import os

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

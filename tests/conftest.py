import os

# Triton runs on a CPU only in interpreter mode, and the variable must be set
# before triton is first imported anywhere in the test session.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

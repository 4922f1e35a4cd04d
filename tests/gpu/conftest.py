"""tests/gpu/: the GPU checks (check_engine.py, check_quant.py, check_triton.py: scripts
a person runs on a lent GPU, one prepared command each) and their tests.

    test_check_*.py   their parts and their CPU smoke modes: collected everywhere
    test_on_gpu.py    each check on CUDA, its defaults: collected only where torch sees
                      a CUDA device, so a CPU-only run skips it cleanly (not even imported)
"""

from __future__ import annotations

import torch

collect_ignore = [] if torch.cuda.is_available() else ["test_on_gpu.py"]

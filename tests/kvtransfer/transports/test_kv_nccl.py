"""kvtransfer/transports/nccl.py on a CPU: the torch.distributed transport's shape (its
pages moving over gloo between workers: tests/services/worker/test_worker_kv_transfer.py)."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.transports.nccl import TorchDistConfig, TorchDistReceiver, TorchDistSender


def test_nccl_is_the_gloo_transport_on_cuda_memory(tiny_kv):
    """NCCL shares every line with gloo but the backend's name and the KV device: the
    channel and the point-to-point mover are the same objects (what a CPU can check)."""
    with pytest.raises(ValueError, match="backend: nccl moves cuda tensors"):
        TorchDistReceiver(tiny_kv, "tcp://127.0.0.1:0", TorchDistConfig(backend="nccl"))
    gloo, nccl = TorchDistSender(), TorchDistSender(TorchDistConfig(backend="nccl"))
    try:
        assert type(gloo.pages) is type(nccl.pages) and gloo.transport == nccl.transport == "torch"
        assert gloo.pages.via == nccl.pages.via == "p2p"
    finally:
        gloo.close()
        nccl.close()

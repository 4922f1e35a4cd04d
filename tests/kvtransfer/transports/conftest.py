"""Fixtures the transport tests share: CURVE certificates and a tiny KV cache."""

from __future__ import annotations

import pytest
import torch
import zmq.auth


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    for who in ("server", "client", "stranger"):
        (root / who).mkdir()
        zmq.auth.create_certificates(root / who, who)
    (root / "authorized").mkdir()
    (root / "authorized" / "client.key").write_bytes((root / "client" / "client.key").read_bytes())
    return root


@pytest.fixture
def tiny_kv() -> torch.Tensor:
    return torch.zeros((2, 8, 2, 4, 1, 8), dtype=torch.float16)

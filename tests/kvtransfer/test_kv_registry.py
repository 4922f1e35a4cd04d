"""kvtransfer/registry.py: `--kv-connector` names a transport (or a plug-in, or none),
and a worker's connector gets the sides its role needs."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.kvtransfer import registry
from pdserve.kvtransfer.registry import KVCredentials, TransportContext, factory, open_connector


def kv() -> torch.Tensor:
    return torch.zeros((2, 8, 2, 4, 1, 8))


def test_names_map_to_factories_and_none_to_no_transfer():
    assert factory("zmq") is registry.zmq_tcp and factory(" gloo ") is registry.gloo
    assert factory("") is None and factory("none") is None
    assert factory("pdserve.services.worker.kv_connectors:zmq_ipc_connector") is registry.zmq_ipc  # the old spelling
    assert factory("fake_kv_transport:plugin").__name__ == "plugin"


@pytest.mark.parametrize("spec, match", [
    ("carrier-pigeon", "is not one of"),
    (":x", "expected 'module:factory'"),
    ("fake_kv_transport:nothing", "has no factory"),
])
def test_an_unknown_transport_is_refused_naming_kv_connector(spec, match):
    with pytest.raises(ValueError, match=f"kv_connector: .*{match}|kv_connector: {match}"):
        factory(spec)


@pytest.mark.parametrize("role, decode, prefill", [("decode", True, False), ("prefill", False, True), ("mixed", True, True)])
def test_a_worker_gets_the_sides_of_its_role(role, decode, prefill):
    connector = open_connector("fake_kv_transport:plugin", TransportContext(role, "w1", kv()), vocab_size=10)
    try:
        assert (connector.decode is not None, connector.prefill is not None) == (decode, prefill)
        connector.start()
        assert connector.endpoint == ("fake://w1" if decode else "fake-sender:w1")
    finally:
        connector.close()


def test_no_transfer_moves_nothing_and_advertises_nothing():
    connector = open_connector("none", TransportContext("mixed", "w1", kv()), vocab_size=10)
    connector.start()
    assert connector.decode is None and connector.prefill is None and connector.endpoint == ""
    connector.close()


def test_the_context_reads_the_kv_host_and_ipc_directory_from_the_environment():
    ctx = TransportContext.from_env("decode", "w", kv(), KVCredentials(),
                                    {registry.HOST_ENV: "10.0.0.7", registry.IPC_DIR_ENV: "/run/kv"})
    assert (ctx.host, ctx.ipc_dir) == ("10.0.0.7", "/run/kv")
    assert TransportContext.from_env("decode", "w", kv(), environ={}).host == "127.0.0.1"
    with pytest.raises(ValueError, match="role"):
        TransportContext("router", "w", kv())


def test_an_ipc_receiver_without_a_directory_makes_one_and_removes_it():
    transport = registry.zmq_ipc(TransportContext("decode", "w/1", kv()))
    try:
        endpoint = transport.receiver.start()
        path = endpoint.removeprefix("ipc://")
        assert os.path.exists(path) and "/" not in os.path.basename(path)
    finally:
        transport.receiver.close()
        transport.cleanup()
    assert not os.path.exists(os.path.dirname(path))

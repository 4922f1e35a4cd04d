"""kvtransfer/transports/curve.py: CURVE keys from files and the environment, checked."""

from __future__ import annotations

import pytest
import zmq.auth

from pdserve.kvtransfer.transports.curve import CurveConfig
from pdserve.kvtransfer.transports.zmq import ZmqConfig, ZmqReceiver


def test_curve_keys_from_env_and_validation(certs, tiny_kv):
    server_pub, server_sec = zmq.auth.load_certificate(certs / "server" / "server.key_secret")
    client_pub, _ = zmq.auth.load_certificate(certs / "client" / "client.key")
    env = {"KV_SECRET_CERT": str(certs / "server" / "server.key_secret"), "KV_AUTHORIZED_KEYS": client_pub.decode()}
    cfg = CurveConfig.from_env(env, prefix="KV_")
    assert cfg.public_key == server_pub and cfg.authorized_keys == {client_pub}
    env = {"KV_PUBLIC_KEY": server_pub.decode(), "KV_SECRET_KEY": server_sec.decode(), "KV_AUTHORIZED_DIR": str(certs / "authorized")}
    assert CurveConfig.from_env(env, prefix="KV_").authorized_keys == {client_pub}
    assert CurveConfig.from_env({}, prefix="KV_") is None
    with pytest.raises(ValueError, match="secret_key"):
        CurveConfig(server_pub, b"too short")
    with pytest.raises(ValueError, match="authorized_keys"):
        ZmqReceiver(tiny_kv, "tcp://127.0.0.1:0", ZmqConfig(curve=CurveConfig(server_pub, server_sec)))

"""CURVE keys of a KV endpoint: who may send pages to a receiver, and whom a sender
trusts to be one.

    receiver: its own key pair + the senders' public keys it admits (authorized_keys)
    sender:   its own key pair + the receiver's public key (server_key)

Only keys here: the ZeroMQ control channel (kvtransfer/transports/channel.py) turns them into a
CURVE handshake and a ZAP check. Services load these without loading a transport.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85


def _z85_key(value: bytes | str, what: str) -> bytes:
    key = value.encode() if isinstance(value, str) else bytes(value)
    key = key.strip()
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except Exception:
        ok = False
    if not ok:
        raise ValueError(f"{what}: not a 40-character Z85 CURVE key")
    return key


@dataclass(frozen=True)
class CurveConfig:
    """CURVE keys of one endpoint (all Z85 text).

    Receiver: its own keypair, and `authorized_keys`, the client public keys allowed to
    send (required: a CURVE server that admits anyone is not authentication). Sender:
    its own keypair, and `server_key`, the receiver's public key (a transfer target may
    carry its own instead).
    """

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None
    authorized_keys: frozenset[bytes] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _z85_key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", _z85_key(self.secret_key, "secret_key"))
        if self.server_key is not None:
            object.__setattr__(self, "server_key", _z85_key(self.server_key, "server_key"))
        keys = frozenset(_z85_key(k, "authorized_keys") for k in self.authorized_keys)
        object.__setattr__(self, "authorized_keys", keys)

    @classmethod
    def from_files(cls, secret_cert: str | Path, server_cert: str | Path | None = None,
                   authorized: str | Path | Sequence[str | Path] = ()) -> "CurveConfig":
        """Keys from ZeroMQ certificate files (`zmq.auth.create_certificates`).

        `authorized` is a directory of public certificates or a list of files.
        """
        public, secret = zmq.auth.load_certificate(secret_cert)
        if secret is None:
            raise ValueError(f"secret_cert: {secret_cert} holds no secret key")
        server = zmq.auth.load_certificate(server_cert)[0] if server_cert is not None else None
        if isinstance(authorized, (str, Path)):
            files = sorted(Path(authorized).glob("*.key"))
        else:
            files = [Path(p) for p in authorized]
        keys = frozenset(zmq.auth.load_certificate(f)[0] for f in files)
        return cls(public, secret, server, keys)

    @classmethod
    def shared(cls, secret_key: bytes) -> "CurveConfig":
        """One key pair for a whole cluster, from its 32-byte secret key (any 32 random
        bytes are a Curve25519 secret key): every endpoint sends with it, knows the
        receivers' public key (its own) and admits exactly that key. What a deployment
        that can only hand out random bytes (the Helm chart) uses; a holder of the key
        is a cluster member, as with the cluster token."""
        if len(secret_key) != 32:
            raise ValueError(f"secret_key: a CURVE secret key is 32 bytes, got {len(secret_key)}")
        secret = z85.encode(secret_key)
        public = zmq.curve_public(secret)
        return cls(public, secret, public, frozenset({public}))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = "PDSERVE_KV_CURVE_") -> "CurveConfig | None":
        """Keys from the environment, or None when CURVE is not configured there.

        `{prefix}SECRET_CERT` (a certificate file) or `{prefix}PUBLIC_KEY` + `{prefix}SECRET_KEY`;
        optional `{prefix}SERVER_KEY` and `{prefix}AUTHORIZED_KEYS` (comma separated)
        or `{prefix}AUTHORIZED_DIR` (a directory of public certificates).
        """
        env = os.environ if environ is None else environ
        get = lambda name: env.get(prefix + name) or None  # noqa: E731
        if get("SECRET_CERT"):
            public, secret = zmq.auth.load_certificate(get("SECRET_CERT"))
        elif get("SECRET_KEY"):
            public, secret = get("PUBLIC_KEY"), get("SECRET_KEY")
            if public is None:
                raise ValueError(f"{prefix}PUBLIC_KEY: required with {prefix}SECRET_KEY")
        else:
            return None
        keys = [k for k in (get("AUTHORIZED_KEYS") or "").split(",") if k.strip()]
        if get("AUTHORIZED_DIR"):
            keys += [zmq.auth.load_certificate(f)[0] for f in sorted(Path(get("AUTHORIZED_DIR")).glob("*.key"))]
        return cls(public, secret, get("SERVER_KEY"), frozenset(k.encode() if isinstance(k, str) else k for k in keys))

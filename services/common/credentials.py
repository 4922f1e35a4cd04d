"""The cluster's credentials: one block of settings (`ClusterCredentials`) that every
service takes as flags and every launcher renders (`pdserve up`, the Ray launcher, the
Helm chart from Kubernetes Secrets). Secrets are always files named by a flag, never
values on a command line or in the environment.

    surface                     protected by                          settings
    Registry (router's          mTLS: every peer shows a certificate  --cluster-ca
      --internal-port),           the cluster CA signed, and/or       --cluster-cert / --cluster-key
    Worker (every worker)       the cluster token in every call's     --cluster-token-file
                                  metadata, checked by a server
                                  interceptor in constant time
    KV pages (ZeroMQ)           CURVE: encrypted, and only listed     --kv-curve-cert
                                  sender keys get a frame through     --kv-curve-authorized
                                  (or one key pair for the cluster,   or --kv-curve-cluster-key
                                  derived from a shared secret key)
    torch.distributed           the cluster token signs every         --cluster-token-file
      rendezvous                  rendezvous value

With nothing configured a service still runs (hand-started development) and says so
in its log; `pdserve up` always configures a fresh token and CURVE keys
(launch/credentials.py). `ClusterAuth` is the block loaded once at startup: the
token read, certificates read, CURVE keys parsed.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from pdserve.services.common.auth import MetadataCheck, same_secret, with_metadata
from pdserve.services.common.flags import check, flag
from pdserve.services.common.keepalive import with_keepalive

if TYPE_CHECKING:
    from pdserve.kvtransfer.transports.curve import CurveConfig

log = logging.getLogger(__name__)
TOKEN_METADATA = "pdserve-cluster-token"
MIN_TOKEN_CHARS = 16
# The fields that configure the KV channel (no use to a service that has none).
KV_CURVE_FIELDS = ("kv_curve_cert", "kv_curve_authorized", "kv_curve_cluster_key")


@dataclass(frozen=True)
class ClusterCredentials:
    cluster_ca: str | None = flag(None, "CA certificate (PEM) that signed every service's --cluster-cert: mTLS "
                                        "on every internal RPC")
    cluster_cert: str | None = flag(None, "this service's certificate (PEM) for internal RPCs, as server and client")
    cluster_key: str | None = flag(None, "private key (PEM) of --cluster-cert")
    cluster_server_name: str | None = flag(None, "name the internal peers' certificates carry (checked instead of "
                                                 "the host dialed, e.g. one name for a whole cluster)")
    cluster_token_file: str | None = flag(None, "file holding the cluster token: every internal RPC carries it and "
                                                "every internal server checks it")
    kv_curve_cert: str | None = flag(None, "this worker's ZeroMQ CURVE secret certificate: KV pages encrypted, "
                                           "senders authenticated")
    kv_curve_authorized: str | None = flag(None, "directory of the public CURVE certificates (*.key) of the "
                                                 "workers allowed to send KV pages here")
    kv_curve_cluster_key: str | None = flag(None, "file holding one CURVE secret key for the whole cluster (32 "
                                                  "random bytes, base64): every worker derives the same key pair "
                                                  "from it and admits only that key (instead of --kv-curve-cert and "
                                                  "--kv-curve-authorized)")

    def __post_init__(self) -> None:
        tls = (self.cluster_ca, self.cluster_cert, self.cluster_key)
        check(all(tls) or not any(tls), "cluster_ca", "--cluster-ca, --cluster-cert and --cluster-key go together",
              tls)
        for name in ("cluster_ca", "cluster_cert", "cluster_key", "cluster_token_file", "kv_curve_cert",
                     "kv_curve_cluster_key"):
            path = getattr(self, name)
            check(path is None or Path(path).is_file(), name, "must be a readable file", path)
        check(self.kv_curve_authorized is None or Path(self.kv_curve_authorized).is_dir(), "kv_curve_authorized",
              "must be a directory of public certificates", self.kv_curve_authorized)
        check(self.kv_curve_cluster_key is None or (self.kv_curve_cert is None and self.kv_curve_authorized is None),
              "kv_curve_cluster_key", "replaces --kv-curve-cert and --kv-curve-authorized: give one or the others",
              self.kv_curve_cluster_key)

    @property
    def mtls(self) -> bool:
        return self.cluster_ca is not None

    @property
    def configured(self) -> bool:
        """Whether internal RPCs are authenticated at all."""
        return self.mtls or self.cluster_token_file is not None


def read_secret_file(path: str, name: str) -> bytes:
    """A secret file's bytes; warns when others than its owner may read it."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: %s is readable by others than its owner (mode %o)", name, path, stat.S_IMODE(mode))
    return Path(path).read_bytes()


def read_cluster_curve_key(path: str) -> bytes:
    """The 32 bytes of a --kv-curve-cluster-key file (base64 text, e.g. Helm's
    `randBytes 32` or `head -c 32 /dev/urandom | base64`)."""
    text = read_secret_file(path, "kv_curve_cluster_key").strip()
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    check(len(key) == 32, "kv_curve_cluster_key", "must hold 32 bytes, base64 (`head -c 32 /dev/urandom | base64`)",
          path)
    return key


class ClusterAuth:
    """`ClusterCredentials`, loaded: what servers check and clients present."""

    def __init__(self, credentials: ClusterCredentials = ClusterCredentials()) -> None:
        self.credentials = credentials
        self.token: str | None = None
        if credentials.cluster_token_file is not None:
            token = read_secret_file(credentials.cluster_token_file, "cluster_token_file").decode().strip()
            check(len(token) >= MIN_TOKEN_CHARS, "cluster_token_file", f"must hold a token of at least "
                  f"{MIN_TOKEN_CHARS} characters", credentials.cluster_token_file)
            self.token = token
        self._tls: tuple[bytes, bytes, bytes] | None = None
        if credentials.mtls:
            self._tls = (Path(credentials.cluster_ca).read_bytes(), Path(credentials.cluster_cert).read_bytes(),
                         read_secret_file(credentials.cluster_key, "cluster_key"))

    @property
    def configured(self) -> bool:
        return self.credentials.configured

    def warn_if_open(self, what: str) -> None:
        if not self.configured:
            log.warning("%s: no cluster credentials (--cluster-token-file, --cluster-ca/-cert/-key): anyone who "
                        "reaches its internal port is trusted; for hand-started development only", what)

    # -- servers -----------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """mTLS: only peers with a certificate the cluster CA signed get a connection."""
        if self._tls is None:
            return None
        ca, cert, key = self._tls
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        """The token check of every internal call (health checks aside)."""
        if self.token is None:
            return []
        token = self.token

        def check_token(metadata: dict[str, str]) -> str | None:
            given = metadata.get(TOKEN_METADATA)
            if given is None:
                return f"cluster credentials required: no {TOKEN_METADATA} metadata"
            return None if same_secret(given, token) else "cluster credentials required: wrong cluster token"

        return [MetadataCheck(check_token)]

    # -- clients -----------------------------------------------------------------------

    def channel(self, address: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
        """A channel to an internal service, presenting this cluster's credentials
        (with keepalive: services/common/keepalive.py)."""
        options = with_keepalive(options)
        if self._tls is not None:
            ca, cert, key = self._tls
            if self.credentials.cluster_server_name:
                options.append(("grpc.ssl_target_name_override", self.credentials.cluster_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        return with_metadata(channel, [(TOKEN_METADATA, self.token)] if self.token is not None else [])

    # -- the KV channel ----------------------------------------------------------------

    def kv_curve(self) -> CurveConfig | None:
        """CURVE keys of this worker's KV sender and receiver, or None without keys."""
        from pdserve.kvtransfer.transports.curve import CurveConfig

        c = self.credentials
        if c.kv_curve_cluster_key is not None:
            return CurveConfig.shared(read_cluster_curve_key(c.kv_curve_cluster_key))
        if c.kv_curve_cert is None:
            check(c.kv_curve_authorized is None, "kv_curve_authorized", "needs --kv-curve-cert", c.kv_curve_authorized)
            return None
        read_secret_file(c.kv_curve_cert, "kv_curve_cert")  # for the warning
        authorized = c.kv_curve_authorized if c.kv_curve_authorized is not None else ()
        return CurveConfig.from_files(c.kv_curve_cert, authorized=authorized)

    @property
    def rendezvous_token(self) -> bytes | None:
        """What signs torch.distributed rendezvous values (kvtransfer/transports/nccl.py)."""
        return self.token.encode() if self.token is not None else None

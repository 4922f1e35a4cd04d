"""Fresh cluster credentials for one launch: a launcher (pdserve up; the Ray launcher)
never starts a cluster without them, and never reuses a previous launch's.

    DIR/                        0700
      cluster-token             0600  256 random bits, hex: every internal RPC carries it
      kv/prefill.key_secret     0600  CURVE key pair of the prefill workers
      kv/decode.key_secret      0600  ... of the decode workers
      kv/mixed.key_secret       0600  ... of the mixed workers
      kv/senders/*.key          0600  the public keys of prefill and mixed workers: the
                                      only senders a decode (or mixed) worker admits

Each role's key pair lets a worker be a KV sender or receiver; only senders' public
keys are authorized, so a decode worker's keys cannot push pages anywhere. What a
service gets is a `ClusterCredentials` block (`for_role`, `for_router`), rendered as
flags like every other setting; mTLS settings the operator gave are kept as they are
(a launcher cannot mint certificates the operator's CA would sign).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

import zmq.auth

from pdserve.services.common.credentials import KV_CURVE_FIELDS, ClusterCredentials
from pdserve.services.common.flags import check
from pdserve.services.worker.config import ROLES

# The ClusterCredentials fields a launch always makes itself (never the operator's).
LAUNCH_MADE = ("cluster_token_file", *KV_CURVE_FIELDS)
SENDERS = ("prefill", "mixed")
TOKEN_FILE = "cluster-token"


def _private_file(path: Path, data: bytes) -> None:
    """Write `data` to a file only its owner can read (0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


@dataclasses.dataclass(frozen=True)
class LaunchCredentials:
    directory: Path
    base: ClusterCredentials  # the operator's own settings (mTLS), kept for every service

    @property
    def token_file(self) -> Path:
        return self.directory / TOKEN_FILE

    def for_router(self) -> ClusterCredentials:
        return dataclasses.replace(self.base, cluster_token_file=str(self.token_file))

    def for_role(self, role: str) -> ClusterCredentials:
        check(role in ROLES, "role", f"must be one of {ROLES}", role)
        kv = self.directory / "kv"
        return dataclasses.replace(
            self.base, cluster_token_file=str(self.token_file), kv_curve_cert=str(kv / f"{role}.key_secret"),
            kv_curve_authorized=str(kv / "senders"),
        )

    def for_client(self) -> ClusterCredentials:
        """What an operator's tool (or a test) needs to call the internal surface."""
        return self.for_router()


def generate(directory: str | Path, base: ClusterCredentials = ClusterCredentials()) -> LaunchCredentials:
    """Fresh token and CURVE key pairs in `directory` (made private; files replaced).
    Raises ValueError if `base` already names a token or CURVE keys: those are the
    launch's own, fresh every time."""
    for name in LAUNCH_MADE:
        check(getattr(base, name) is None, name, "a launcher makes a fresh one for every launch "
              "(keep them with the launcher's --secrets-dir)", getattr(base, name))
    root = _private_dir(Path(directory))
    _private_file(root / TOKEN_FILE, secrets.token_hex(32).encode())
    kv = _private_dir(root / "kv")
    senders = _private_dir(kv / "senders")
    for stale in senders.glob("*.key"):
        stale.unlink()
    for role in ROLES:
        public, secret = zmq.auth.create_certificates(kv, role)
        for path in (public, secret):
            os.chmod(path, 0o600)
        if role in SENDERS:
            _private_file(senders / f"{role}.key", Path(public).read_bytes())
    return LaunchCredentials(root, base)


# -- carrying credentials to a service on another machine (the Ray launcher) -----------

FILE_FIELDS = ("cluster_ca", "cluster_cert", "cluster_key", "cluster_token_file", "kv_curve_cert",
               "kv_curve_cluster_key")


def pack(credentials: ClusterCredentials) -> dict[str, dict[str, str]]:
    """The files a `ClusterCredentials` names, as text: {field: {file name: content}}
    (a directory field, `kv_curve_authorized`, carries each of its *.key files). For a
    service that starts where the launcher's files are not (a Ray actor on another
    node): plain strings, written back by `unpack` into a private directory there."""
    packed: dict[str, dict[str, str]] = {}
    for name in FILE_FIELDS:
        path = getattr(credentials, name)
        if path is not None:
            packed[name] = {Path(path).name: Path(path).read_text()}
    if credentials.kv_curve_authorized is not None:
        packed["kv_curve_authorized"] = {p.name: p.read_text() for p in Path(credentials.kv_curve_authorized).glob("*.key")}
    return packed


def unpack(packed: dict[str, dict[str, str]], directory: str | Path,
           base: ClusterCredentials = ClusterCredentials()) -> ClusterCredentials:
    """Write what `pack` carried into `directory` (made private, files 0600) and
    return `base` with every carried field pointing at its new file."""
    root = _private_dir(Path(directory))
    paths: dict[str, str] = {}
    for name, files in packed.items():
        if name not in (*FILE_FIELDS, "kv_curve_authorized"):
            raise ValueError(f"credentials: unknown field {name!r}")
        folder = _private_dir(root / name)
        for file_name, content in files.items():
            if Path(file_name).name != file_name or file_name in ("", ".", ".."):
                raise ValueError(f"credentials.{name}: bad file name {file_name!r}")
            _private_file(folder / file_name, content.encode())
        paths[name] = str(folder) if name == "kv_curve_authorized" else str(folder / next(iter(files)))
    return dataclasses.replace(base, **paths)

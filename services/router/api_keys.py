"""API keys of the public API: who may call `Generation` at all.

    --api-keys-file FILE     one key a line; blank lines and `#` comments ignored
    client metadata          authorization: Bearer <key>

Every public call (health checks and reflection aside: they reveal nothing a client's
proto does not) is checked by a server interceptor before anything else happens to
it, validation included; without a valid key it ends UNAUTHENTICATED. The file is read
at start and again on SIGHUP (`reload`): a file that cannot be read keeps the keys in
force. Keys are kept only as sha256 digests; a key's id (`key_id`: a prefix of its
digest, safe to log) names its tenant, e.g. in front of its requests' cache salt.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import grpc

from pdserve.services.common.auth import HEALTH_PREFIX, REFLECTION_PREFIX, MetadataCheck

log = logging.getLogger(__name__)
AUTHORIZATION = "authorization"
BEARER = "bearer "
MIN_KEY_CHARS = 16


def key_id(key: str) -> str:
    """A key's public name: 16 hex digits of its sha256 (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def read_keys(path: str) -> dict[bytes, str]:
    """sha256(key) -> key id for every key in the file. Raises ValueError naming the
    line of a key too short to be one."""
    keys: dict[bytes, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise ValueError(f"api_keys_file: line {number}: a key is at least {MIN_KEY_CHARS} characters, no spaces")
        keys[hashlib.sha256(key.encode()).digest()] = key_id(key)
    return keys


class ApiKeys:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._keys = read_keys(path)
        log.info("api keys: %d from %s", len(self._keys), path)

    def reload(self) -> bool:
        """Read the file again; on failure keep the current keys (and say why)."""
        try:
            keys = read_keys(self.path)
        except (OSError, ValueError) as e:
            log.error("api keys: keeping the %d in force, cannot reload %s: %s", len(self._keys), self.path, e)
            return False
        with self._lock:
            self._keys = keys
        log.info("api keys: reloaded %d from %s", len(keys), self.path)
        return True

    def identify(self, metadata: dict[str, str]) -> str | None:
        """The id of the valid key a call carries, or None. Looks the key up by its
        digest, so the time taken tells nothing about the keys held."""
        value = metadata.get(AUTHORIZATION, "")
        if not value[: len(BEARER)].lower() == BEARER:
            return None
        digest = hashlib.sha256(value[len(BEARER):].strip().encode()).digest()
        with self._lock:
            return self._keys.get(digest)

    def interceptor(self) -> grpc.ServerInterceptor:
        def check(metadata: dict[str, str]) -> str | None:
            if AUTHORIZATION not in metadata:
                return "API key required: send `authorization: Bearer <key>` metadata"
            return None if self.identify(metadata) is not None else "API key not valid"

        return MetadataCheck(check, exempt=(HEALTH_PREFIX, REFLECTION_PREFIX))

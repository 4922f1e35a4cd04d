"""Chained block hashes, identical in every process.

    block 0            block 1            block 2 (partial: never hashed)
    [t0 .. t15]        [t16 .. t31]       [t32 .. t37]
    h0 = H(ROOT, b0)   h1 = H(h0, b1)

`H` is sha256 over a canonical byte encoding (parent digest, then the block's token
ids as little-endian int64, then the extra keys as UTF-8), so the router, every
prefill worker and every decode worker agree, whatever the Python process
(never Python's salted `hash()`). Only full blocks get a hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32-byte sha256 digest

ROOT_HASH: BlockHash = hashlib.sha256(b"pdserve/block-hash/v1").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash = ROOT_HASH,
    extra_keys: Sequence[str] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, chained from `parent`."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes

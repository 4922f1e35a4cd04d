"""Chained block hashes, identical in every process.

    block 0                    block 1            block 2 (partial: never hashed)
    [t0 .. t15]                [t16 .. t31]       [t32 .. t37]
    h0 = H(ROOT, b0, salt)     h1 = H(h0, b1)

`H` is sha256 over a canonical byte encoding (parent digest, then the block's token
ids as little-endian int64, then the extra keys as length-prefixed UTF-8), so the
router, every prefill worker and every decode worker agree, whatever the Python
process (never Python's salted `hash()`). Only full blocks get a hash.

A request's optional cache salt (`SamplingParams.cache_salt`, vLLM's `cache_salt`)
is an extra key of the first block only; the chain carries it into every later
hash. Requests with different salts therefore never share a cached block, and
cannot learn through `cached_tokens` or timing what the other one cached.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32-byte sha256 digest

ROOT_HASH: BlockHash = hashlib.sha256(b"pdserve/block-hash/v1").digest()
SALT_KEY_PREFIX = "cache_salt:"  # keeps a salt apart from any other extra key


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def block_extra_keys(index: int, cache_salt: str | None) -> tuple[str, ...]:
    """The extra keys of block `index` of a request: its salt, on block 0 only."""
    return (SALT_KEY_PREFIX + cache_salt,) if index == 0 and cache_salt else ()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash = ROOT_HASH,
    extra_keys: Sequence[str] = (),
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, chained from `parent`; the salt
    enters the first block (so only a chain from ROOT_HASH may carry one)."""
    if cache_salt and parent != ROOT_HASH:
        raise ValueError("cache_salt: only the first block of a chain (parent ROOT_HASH) is salted")
    hashes: list[BlockHash] = []
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        keys = (*extra_keys, *block_extra_keys(index, cache_salt))
        parent = hash_block(parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)
    return hashes

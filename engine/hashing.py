"""Chained block hashes, identical in every process.

    block 0                    block 1            block 2 (partial: never hashed)
    [t0 .. t15]                [t16 .. t31]       [t32 .. t37]
    h0 = H(ROOT, b0, salt)     h1 = H(h0, b1)

`H` is sha256 over a canonical byte encoding (parent digest, then the block's token
ids as little-endian int64, then the extra keys as length-prefixed UTF-8), so the
router, every prefill worker and every decode worker agree, whatever the Python
process (never Python's salted `hash()`). Only full blocks get a hash.

A prompt is hashed once per process: the router hashes it and sends the hashes with
the request; a worker checks them once against its own computation
(`checked_block_hashes`), then passes them down (engine requests, the KV connector)
so nothing hashes that prompt again. A prompt that grows (a request continued
after the tokens it had sent) hashes only its new blocks (`extended_block_hashes`).

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


class BlockHashMismatch(ValueError):
    """Block hashes a peer sent (the router's) differ from this process's own for the
    same prompt: the two differ in tokenizer, block size or cache salt. A precondition
    of the cluster, not the request's fault (FAILED_PRECONDITION)."""


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


def extended_block_hashes(
    known: Sequence[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
) -> list[BlockHash]:
    """The hashes of every full block of `token_ids`, whose first len(known) blocks'
    are `known` (a prefix's, e.g. a prompt's before the tokens sent after it were
    appended): only the blocks after those are hashed. The salt is block 0's, so it
    only matters when `known` is empty."""
    start = len(known) * block_size
    if start > len(token_ids):
        raise ValueError(f"block_hashes: {len(known)} known for {len(token_ids)} tokens in blocks of {block_size}")
    if not known:
        return hash_blocks(token_ids, block_size, cache_salt=cache_salt)
    return [*known, *hash_blocks(token_ids[start:], block_size, parent=known[-1])]


def checked_block_hashes(
    sent: Sequence[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
    field: str = "block_hashes",
) -> list[BlockHash]:
    """The prompt's block hashes, computed here once and checked against `sent` (a
    peer's, e.g. the router's; empty: none sent, ours are returned). Raises
    ValueError naming `field` for a list of the wrong length or a hash of the wrong
    size, BlockHashMismatch when the values differ (another tokenizer, block size or
    salt: the message says so)."""
    ours = hash_blocks(token_ids, block_size, cache_salt=cache_salt)
    if not sent:
        return ours
    if len(sent) != len(ours):
        raise BlockHashMismatch(
            f"{field}: {len(sent)} hashes for a prompt of {len(token_ids)} tokens, which has {len(ours)} full "
            f"blocks of {block_size} tokens here (a different block size?)")
    for i, h in enumerate(sent):
        if not isinstance(h, bytes) or len(h) != len(ROOT_HASH):
            size = len(h) if isinstance(h, bytes) else type(h).__name__
            raise ValueError(f"{field}[{i}]: {size} bytes; a block hash has {len(ROOT_HASH)}")
    first = next((i for i, (a, b) in enumerate(zip(sent, ours)) if a != b), None)
    if first is not None:
        raise BlockHashMismatch(
            f"{field}[{first}]: differs from this worker's hash of the same prompt block: the sender and this "
            f"worker differ in tokenizer, block size ({block_size} here) or cache salt")
    return ours

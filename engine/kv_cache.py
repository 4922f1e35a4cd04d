"""Per-request view of the block pool: which blocks hold a request's KV.

    request tokens   [ block 0 | block 1 | block 2 | blo.. ]
    block table      [   17    |    3    |   42    |  8   ]
    computed         <------- num_computed_tokens ------>

`get_computed_blocks` finds the longest cached prefix (capped so the last token is
always computed, since its logits are needed); `allocate_slots` takes references on
those blocks and allocates the rest, or returns False and changes nothing;
`cache_full_blocks` registers newly computed full blocks under their hashes;
with tiers below the pool (`lower`, engine/offload/tiers.py), a lookup that misses
the pool first asks them to copy the next blocks up into the pool's cache, then goes
on finding them there, as device hits;
`fragmentation` is the share of allocated slots that hold no token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.block_pool import Block, BlockPool
from pdserve.engine.request import Request


class LowerTiers(Protocol):
    """The tiers below the pool, as a lookup sees them (engine/offload/tiers.py)."""

    def locate(self, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[str]: ...

    def onload(self, pool: BlockPool, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]],
               hold: Sequence[Block] = ()) -> int: ...

    def count_miss(self) -> None: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, lower: LowerTiers | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.lower = lower
        self.req_blocks: dict[str, list[Block]] = {}
        self._requests: dict[str, Request] = {}  # the holder of each req_blocks entry (for fragmentation)
        self._num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up (by admissions that used the lookup)
        self.prefix_cache_hits = 0  # tokens found

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached blocks from the start of the request, and its token count.
        Counts nothing in the pool (the caller that uses the result calls `record_lookup`
        once); blocks copied up from a lower tier count as that tier's hits."""
        if not self.pool.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        hits = self._device_hits(request, [], max_blocks)
        if self.lower is not None and len(hits) < max_blocks and self._onload(request, hits, max_blocks):
            hits = self._device_hits(request, hits, max_blocks)
        return hits, len(hits) * self.block_size

    def _device_hits(self, request: Request, hits: list[Block], max_blocks: int) -> list[Block]:
        """`hits` extended by the cached blocks that follow them, up to `max_blocks`."""
        bs = self.block_size
        hits = list(hits)
        for i in range(len(hits), max_blocks):
            block = self.pool.lookup(request.block_hashes[i], request.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def _token_blocks(self, request: Request, start: int, end: int) -> list[list[int]]:
        bs = self.block_size
        return [request.token_ids[i * bs : (i + 1) * bs] for i in range(start, end)]

    def _onload(self, request: Request, hits: list[Block], max_blocks: int) -> int:
        """Blocks after `hits` copied up from the lower tiers into the pool's cache (the
        hits are held meanwhile, so the onload's allocation cannot take them). The
        first block is looked for alone: a new prompt costs one lookup, not a slicing
        of every block's tokens."""
        assert self.lower is not None
        start = len(hits)
        if not self.lower.locate(request.block_hashes[start : start + 1], self._token_blocks(request, start, start + 1)):
            return 0
        return self.lower.onload(self.pool, request.block_hashes[start:max_blocks],
                                 self._token_blocks(request, start, max_blocks), hits)

    def prefix_tiers(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[str]:
        """Where each block of the longest run found from the start of these tokens sits:
        "device", then "host" or "disk" (engine/offload/tiers.py); nothing is moved or
        counted. For the services: a reservation's, a KV event's or the router's view
        of what a prefix would cost."""
        if not self.pool.enable_caching:
            return []
        bs = self.block_size
        max_blocks = min((len(token_ids) - 1) // bs, len(block_hashes))
        found: list[str] = []
        for i in range(max_blocks):
            if self.pool.lookup(block_hashes[i], token_ids[i * bs : (i + 1) * bs]) is None:
                break
            found.append("device")
        if self.lower is not None:
            start = len(found)
            blocks = [token_ids[i * bs : (i + 1) * bs] for i in range(start, max_blocks)]
            found += self.lower.locate(block_hashes[start:max_blocks], blocks)
        return found

    def record_lookup(self, request: Request, num_hit: int) -> None:
        """Count one prefix-cache lookup of `request` that found `num_hit` tokens (and,
        when it stopped short of the most it could find, a miss in every lower tier)."""
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        looked = self.pool.enable_caching and request.sampling_params.prompt_logprobs is None
        if self.lower is not None and looked and num_hit < max_blocks * self.block_size:
            self.lower.count_miss()

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[Block] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        computed = computed or []
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks) - len(computed)
        # Cached blocks that sit in the free queue are not available for allocation.
        reusable = sum(1 for b in computed if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reusable:
            if not blocks:
                del self.req_blocks[request.request_id]
                self._requests.pop(request.request_id, None)
            return False
        self._requests[request.request_id] = request
        self.pool.touch(computed)
        blocks.extend(computed)
        if needed > 0:
            new = self.pool.allocate(needed)
            assert new is not None  # checked above
            blocks.extend(new)
        self._num_cached.setdefault(request.request_id, len(computed))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register every full block whose KV is now computed."""
        if not self.pool.enable_caching:
            return
        blocks = self.req_blocks[request.request_id]
        start = self._num_cached.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        bs = self.block_size
        for i in range(start, end):
            self.pool.cache(blocks[i], request.block_hashes[i], request.token_ids[i * bs : (i + 1) * bs])
        self._num_cached[request.request_id] = max(start, end)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give `child` the parent's computed KV: full blocks shared by reference, the
        partial last block copied (copy on write: the two will write different tokens
        into it). Returns the (src, dst) block copies to perform, or None (nothing
        changed) when no block is free for the copy.
        """
        blocks = self.req_blocks[parent.request_id]
        num_full = parent.num_computed_tokens // self.block_size
        used = -(-parent.num_computed_tokens // self.block_size)
        shared, partial = blocks[:num_full], blocks[num_full:used]
        fresh = self.pool.allocate(len(partial))
        if fresh is None:
            return None
        self.pool.touch(shared)
        self.req_blocks[child.request_id] = shared + fresh
        self._requests[child.request_id] = child
        self._num_cached[child.request_id] = min(self._num_cached.get(parent.request_id, 0), num_full)
        return [(src.block_id, dst.block_id) for src, dst in zip(partial, fresh)]

    def trim(self, request: Request) -> None:
        """Free the request's blocks past what its tokens need (lookahead slots of
        rejected drafts), last first."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-request.num_tokens // self.block_size)
        if blocks is not None and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(extra))

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first so a sequence's ends are evicted first."""
        blocks = self.req_blocks.pop(request_id, [])
        self._num_cached.pop(request_id, None)
        self._requests.pop(request_id, None)
        self.pool.free(reversed(blocks))

    def fragmentation(self) -> float:
        """Allocated KV slots holding no token / allocated slots, over the distinct
        blocks live requests hold (0.0 when none is held). A request's tokens are
        those whose KV its blocks hold: computed, or found in the prefix cache (a
        reservation's hits before its KV arrives).

            request A  [ 16 | 16 |  5 ..... ]      blocks shared by a prefix or a fork
            request B  [ 16 | 16 |  9 ... | .. ]   count once: 5 blocks, 80 slots,
                                                   16+16+5+9 tokens -> 34/80 empty

        Shared blocks are full in every holder (prefix-cache hits and the blocks a fork
        shares are whole), so only each holder's tail past its full blocks is walked:
        O(requests), cheap enough for every engine iteration's stats."""
        used = self.pool.num_blocks - self.pool.num_free_blocks  # blocks with a reference
        if used == 0:
            return 0.0
        bs = self.block_size
        tails: dict[int, int] = {}  # block id -> tokens in it, for blocks not full in their holder
        for request_id, blocks in self.req_blocks.items():
            request = self._requests[request_id]
            tokens = min(max(request.num_computed_tokens, request.num_cached_tokens), len(blocks) * bs)
            for i in range(tokens // bs, len(blocks)):
                held = min(bs, max(0, tokens - i * bs))
                tails[blocks[i].block_id] = max(tails.get(blocks[i].block_id, 0), held)
        return sum(bs - held for held in tails.values()) / (used * bs)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if set(self._requests) != set(self.req_blocks):
            raise RuntimeError(f"kv cache: holders {sorted(self._requests)} but blocks of {sorted(self.req_blocks)}")
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise RuntimeError(
                    f"kv cache: block {block.block_id} ref_cnt {block.ref_cnt} but "
                    f"{refs.get(block.block_id, 0)} request references"
                )

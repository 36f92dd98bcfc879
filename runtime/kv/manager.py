"""KVCacheManager: one block table per request over a single KV cache group.

The scheduler talks to the cache only through this class (pure Python, no tensors):
get_computed_blocks() for prefix-cache hits, allocate_slots() before each step, free() when a
request finishes or is preempted. The model runner reads block_ids() to build block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from runtime.kv.block_pool import BlockPool, KVBlock, hash_block_tokens


class ComputedBlocks(NamedTuple):
    """Prefix-cache hits for a request: block ids to reuse and how many tokens they hold."""

    block_ids: list[int]
    num_tokens: int


class _Hits(NamedTuple):
    """Validated prefix hits: the blocks and their chained hashes, in table order."""

    blocks: list[KVBlock]
    hashes: list[int]


class _RequestBlocks:
    """A request's block table, the chained hashes of its leading full, verified blocks, how
    many of those came from prefix hits, and how many have their next token noted
    (KVBlock.next_token)."""

    __slots__ = ("blocks", "block_hashes", "num_hits", "num_noted")

    def __init__(self) -> None:
        self.blocks: list[KVBlock] = []
        self.block_hashes: list[int] = []
        self.num_hits = 0
        self.num_noted = 0


class KVCacheManager:
    """Block tables, prefix caching and usage accounting for all requests (mutable)."""

    __slots__ = ("block_size", "enable_prefix_caching", "match_next_token", "_pool", "_requests",
                 "_hit_tokens", "_queried_tokens")

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        match_next_token: bool = False,
    ) -> None:
        """match_next_token: every block of a hit must have been followed by the same token as
        in the request that takes it (an EAGLE drafter's KV at a block's last position was
        written with the token after it; see get_computed_blocks)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.match_next_token = match_next_token
        self._pool = BlockPool(num_blocks, enable_prefix_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        self._hit_tokens = 0
        self._queried_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate_slots can still hand out (cached-but-unused blocks count as free)."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block 0) held by some request."""
        usable = self._pool.num_blocks - 1
        return (usable - self._pool.num_free_blocks) / usable

    @property
    def hits_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, summed over first allocations."""
        return self._hit_tokens

    @property
    def queried_tokens(self) -> int:
        """Tokens looked up in the prefix cache, summed over first allocations."""
        return self._queried_tokens

    @property
    def pool(self) -> BlockPool:
        """The underlying block pool (for inspection; mutate it only through this manager)."""
        return self._pool

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, so that later requests compute theirs again (a benchmark's
        next run of the same prompts); the number of blocks forgotten. Only between requests:
        ValueError while any request holds blocks."""
        if self._requests:
            raise ValueError(f"cannot reset the prefix cache while {len(self._requests)} "
                             "requests hold blocks")
        return self._pool.reset_prefix_cache()

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table; ValueError for an unknown request."""
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"no blocks allocated for request {request_id!r}")
        return [block.block_id for block in state.blocks]

    def get_computed_blocks(self, token_ids: Sequence[int]) -> ComputedBlocks:
        """Longest chain of cached full blocks that prefixes token_ids. Does not mutate.

        Never covers the whole sequence: at most (len(token_ids) - 1) // block_size blocks, so at
        least one token is left to compute for its logits. Example, block_size 4: 8 tokens ->
        at most 1 block (4 tokens) even if both blocks are cached; 9 tokens -> at most 2.

        With match_next_token, the hit ends before the first block that was followed by another
        token in the request that cached it, or whose next token is not noted yet (unknown, or
        its KV not complete): the blocks' hashes cover their own tokens, not the one after,
        which a drafter's KV at a block's last position depends on. Every block is checked, as
        a chain may hold blocks that different requests cached. Example, block_size 4:
        [1..8, 9, 10] after [1..8, 7, 7] -> 1 block.
        """
        if not self.enable_prefix_caching or not token_ids:
            return ComputedBlocks([], 0)
        blocks: list[KVBlock] = []
        parent: int | None = None
        for index in range((len(token_ids) - 1) // self.block_size):
            parent = hash_block_tokens(parent, self._block_tokens(token_ids, index))
            block = self._pool.get_cached_block(parent)
            if block is None or (self.match_next_token and block.next_token
                                 != token_ids[(index + 1) * self.block_size]):
                break
            blocks.append(block)
        return ComputedBlocks([b.block_id for b in blocks], len(blocks) * self.block_size)

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_block_ids: Sequence[int] = (),
        num_complete: int | None = None,
    ) -> list[int] | None:
        """Grow the request's block table to cover computed + new + lookahead token slots.

        new_computed_block_ids: hits from get_computed_blocks (call it right before this), only
        on the request's first allocation; they are ref'd and head its table, and
        num_computed_tokens already counts their tokens. Returns the newly allocated block ids
        (maybe []), or None if the free blocks do not suffice, counting that ref'ing a cached
        free block takes it out of the free pool; on None nothing has changed.

        Then registers in the prefix cache each block full of verified tokens among the first
        min(len(token_ids), num_computed_tokens + num_new_tokens) (token_ids holds verified
        tokens only; draft tokens fill lookahead slots and are never cached). Example,
        block_size 4, 10 tokens, 0 computed, 10 new, 3 lookahead: ceil(13 / 4) = 4 blocks, and
        blocks 0 and 1 (tokens 0..7) are cached.

        num_complete: positions from this one on lack KV in some layers for now (a drafter's
        rows waiting to be written); the next tokens of blocks holding them are not noted yet,
        so with match_next_token no hit ends in them (see free). None: all are complete.
        """
        if min(num_computed_tokens, num_new_tokens, num_lookahead_tokens) < 0:
            raise ValueError(
                f"token counts must be >= 0, got computed={num_computed_tokens}, "
                f"new={num_new_tokens}, lookahead={num_lookahead_tokens}"
            )
        state = self._requests.get(request_id)
        hits = self._checked_hits(request_id, state, token_ids, num_computed_tokens,
                                  new_computed_block_ids)
        num_slots = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_needed = -(-num_slots // self.block_size)  # ceil
        num_held = len(state.blocks) if state is not None else 0
        num_to_allocate = max(0, num_needed - num_held - len(hits.blocks))
        num_revived = sum(1 for block in hits.blocks if block.ref_cnt == 0)
        if num_to_allocate + num_revived > self._pool.num_free_blocks:
            return None

        if state is None:
            state = self._requests[request_id] = _RequestBlocks()
            if self.enable_prefix_caching:
                self._queried_tokens += len(token_ids)
                self._hit_tokens += len(hits.blocks) * self.block_size
        self._pool.touch(hits.blocks)  # before get_new_blocks, so it cannot evict them
        state.blocks.extend(hits.blocks)
        state.block_hashes.extend(hits.hashes)
        state.num_hits += len(hits.blocks)
        new_blocks = self._pool.get_new_blocks(num_to_allocate)
        state.blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            num_verified = min(len(token_ids), num_computed_tokens + num_new_tokens)
            self._cache_full_blocks(state, token_ids, num_verified // self.block_size)
            self._note_next_tokens(state, token_ids, num_complete)
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str, token_ids: Sequence[int] = (),
             num_complete: int | None = None) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted first (its
        leading blocks are the likeliest to be shared). token_ids: the request's tokens now
        (its last cached block may be followed by one it did not have at its last allocation).
        num_complete: positions from this one on lack KV in some layers (a drafter's rows that
        waited for a step that drafts: runtime.speculative.proposer), so the blocks it cached
        that hold them leave the prefix cache; None: all are complete. Unknown request: no-op.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._note_next_tokens(state, token_ids, num_complete)
        if num_complete is not None:
            first = max(state.num_hits, num_complete // self.block_size)
            for index in range(first, len(state.block_hashes)):
                if state.blocks[index].block_hash == state.block_hashes[index]:
                    self._pool.uncache(state.blocks[index])
        self._pool.free_blocks(reversed(state.blocks))

    def _checked_hits(
        self,
        request_id: str,
        state: _RequestBlocks | None,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        block_ids: Sequence[int],
    ) -> _Hits:
        """Resolve hit block ids, checking they still cache token_ids' leading blocks."""
        if not block_ids:
            return _Hits([], [])
        if state is not None:
            raise ValueError(f"request {request_id!r} already has blocks; pass prefix hits only "
                             "on its first allocation")
        if len(block_ids) * self.block_size > num_computed_tokens:
            raise ValueError(f"{len(block_ids)} hit blocks hold more than the "
                             f"{num_computed_tokens} computed tokens")
        hits = _Hits([], [])
        for index, block_id in enumerate(block_ids):
            parent = hits.hashes[-1] if hits.hashes else None
            block_hash = hash_block_tokens(parent, self._block_tokens(token_ids, index))
            block = self._pool.get_cached_block(block_hash)
            if block is None or block.block_id != block_id:
                raise ValueError(f"prefix hit block {block_id} no longer caches block {index} of "
                                 f"request {request_id!r}; call get_computed_blocks just before")
            hits.blocks.append(block)
            hits.hashes.append(block_hash)
        return hits

    def _cache_full_blocks(
        self, state: _RequestBlocks, token_ids: Sequence[int], num_full_blocks: int
    ) -> None:
        """Hash and register the request's full blocks not yet registered (mutates the pool)."""
        for index in range(len(state.block_hashes), num_full_blocks):
            parent = state.block_hashes[-1] if state.block_hashes else None
            block_hash = hash_block_tokens(parent, self._block_tokens(token_ids, index))
            state.block_hashes.append(block_hash)
            self._pool.cache_full_block(state.blocks[index], block_hash)

    def _note_next_tokens(self, state: _RequestBlocks, token_ids: Sequence[int],
                          num_complete: int | None) -> None:
        """Note on each block this request cached the token that follows it, once known and
        once the block's KV is complete (positions below num_complete, if given). Blocks are
        noted in order, so with match_next_token a hit never ends in (or runs past the end of)
        a block not noted yet. A block a hit brought already has its own note, and one whose
        hash another block caches is not cached."""
        known = len(token_ids) - 1 if num_complete is None else min(len(token_ids) - 1,
                                                                    num_complete)
        while (state.num_noted < len(state.block_hashes)
               and (state.num_noted + 1) * self.block_size <= known):
            index = state.num_noted
            block = state.blocks[index]
            if block.block_hash == state.block_hashes[index] and block.next_token is None:
                block.next_token = token_ids[(index + 1) * self.block_size]
            state.num_noted += 1

    def _block_tokens(self, token_ids: Sequence[int], index: int) -> Sequence[int]:
        """Tokens of block `index`: token_ids[index * block_size : (index + 1) * block_size]."""
        return token_ids[index * self.block_size : (index + 1) * self.block_size]

"""KV cache blocks: ref counts, the LRU free queue and the prefix cache.

A block with ref_cnt 0 sits in the free queue. If it also has a block_hash it still holds a
cached prefix: a later request may take it back out of the queue (touch) without recomputing,
until get_new_blocks reaches it at the queue head and evicts it (drops its hash).

Block 0 is the null/padding block: it is never handed out, freed or cached. The model runner
points padded block-table entries at it and uses its slots 0..block_size-1 as scratch space for
padding tokens, so whatever is written there is garbage by design.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """64-bit hash of one full block, chained on the hash of the block before it (None for the
    first block), so equal tokens behind different prefixes hash differently.

    blake2b over a fixed byte encoding: stable across processes and runs (unlike hash()).
    """
    parent = b"\x00" if parent_hash is None else b"\x01" + struct.pack("<Q", parent_hash)
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    digest = hashlib.blake2b(parent + tokens, digest_size=8).digest()
    return int.from_bytes(digest, "little")


class KVBlock:
    """One block of KV slots (mutable). prev_free/next_free link it into the free queue.

    next_token: for a cached block, the token that followed it in the request that cached it
    (None until that request has it). A drafter's KV at a block's last position pairs the
    target's state there with the next token, which the block's hash does not cover."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "next_token", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.next_token: int | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: evict from the head, free onto the tail, and remove
    from the middle in O(1) when a cached free block gets a prefix hit. Mutates the blocks' links.
    """

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None or self._head is block

    def popleft(self) -> KVBlock:
        """Remove and return the least recently freed block; IndexError when empty."""
        if self._head is None:
            raise IndexError("popleft from an empty FreeBlockQueue")
        block = self._head
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Put `block` at the tail (evicted last). It must not be in the queue already."""
        if block in self:
            raise ValueError(f"{block} is already in the free queue")
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` from wherever it is in the queue."""
        if block not in self:
            raise ValueError(f"{block} is not in the free queue")
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        """Ids from head (next evicted) to tail, for tests and debugging."""
        ids, block = [], self._head
        while block is not None:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All blocks of one KV cache group, their ref counts and the prefix cache (mutable).

    Usable blocks are 1..num_blocks-1, handed out in id order at first; block 0 is reserved.
    """

    __slots__ = ("num_blocks", "enable_prefix_caching", "_blocks", "_free", "_cached")

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs >= 2 blocks (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks[1:])
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks get_new_blocks can hand out, cached-but-unreferenced ones included."""
        return len(self._free)

    def block(self, block_id: int) -> KVBlock:
        """The block with this id (no state change)."""
        return self._blocks[block_id]

    def free_queue_ids(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return self._free.block_ids()

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` blocks from the free queue head with ref_cnt 1; a popped block that
        still held a cached prefix is evicted from the prefix cache. ValueError if too few free.
        """
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self.uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix hit); a block at ref_cnt 0 leaves the free
        queue, so it can no longer be evicted."""
        for block in blocks:
            self._check_not_null(block)
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free queue tail in the
        order given, so pass them in eviction-priority order (first = evicted first). Cached
        blocks keep their hash until evicted."""
        for block in blocks:
            self._check_not_null(block)
            if block.ref_cnt < 1:
                raise ValueError(f"{block} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        """The block caching this hash, or None (no state change)."""
        return self._cached.get(block_hash)

    def cache_full_block(self, block: KVBlock, block_hash: int) -> None:
        """Register a block full of computed tokens under its chained hash. No-op when prefix
        caching is off, when the block is already cached, or when another block already caches
        this hash (the first one stays the hit; this one stays uncached). ValueError if the block
        is cached under a different hash."""
        self._check_not_null(block)
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"{block} is already cached under another hash")
            return
        if not self.enable_prefix_caching or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Drop the block from the prefix cache (its KV stays valid for the requests that hold
        it). No-op for a block that is not cached."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            block.next_token = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the free queue keeps its order); the number forgotten.
        ValueError while a request still holds a block: its blocks may be cached, and a request
        admitted later could no longer find what it was told it shares."""
        held = sum(1 for block in self._blocks[1:] if block.ref_cnt)
        if held:
            raise ValueError(f"cannot reset the prefix cache: {held} blocks are still held")
        forgotten = len(self._cached)
        for block in list(self._cached.values()):
            self.uncache(block)
        return forgotten

    def _check_not_null(self, block: KVBlock) -> None:
        if block.block_id == NULL_BLOCK_ID:
            raise ValueError("block 0 is the reserved null block; it is never allocated or freed")

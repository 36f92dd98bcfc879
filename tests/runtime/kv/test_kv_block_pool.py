from __future__ import annotations

import pytest

from runtime.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def _ids(blocks: list[KVBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_hash_is_stable_across_runs() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == 9121524398691793932
    assert hash_block_tokens(first, [5, 6, 7, 8]) == 5094574419050465977
    assert 0 <= first < 2**64


def test_hash_chains_on_parent_and_tokens() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    other_root = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(other_root, [5, 6, 7, 8])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 4, 3])
    assert hash_block_tokens(root, [5, 6, 7, 8]) == hash_block_tokens(root, (5, 6, 7, 8))


def test_free_queue_popleft_append_and_remove_from_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks[1:])
    assert queue.block_ids() == [1, 2, 3, 4] and len(queue) == 4
    queue.remove(blocks[3])
    assert queue.block_ids() == [1, 2, 4]
    assert blocks[3] not in queue and blocks[1] in queue
    assert queue.popleft() is blocks[1]
    queue.append(blocks[3])
    queue.remove(blocks[4])  # the tail
    assert queue.block_ids() == [2, 3] and len(queue) == 2
    with pytest.raises(ValueError):
        queue.append(blocks[2])
    with pytest.raises(ValueError):
        queue.remove(blocks[4])
    queue.popleft()
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_zero_is_reserved_and_blocks_come_out_in_id_order() -> None:
    pool = BlockPool(num_blocks=5)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert _ids(pool.get_new_blocks(1)) == [4]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="block 0"):
        pool.free_blocks([pool.block(0)])


def test_free_appends_in_given_order_and_evicts_least_recently_freed() -> None:
    pool = BlockPool(num_blocks=6)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a])
    pool.free_blocks([b])
    assert pool.free_queue_ids() == [4, 5, 3, 1, 2]
    assert _ids(pool.get_new_blocks(4)) == [4, 5, 3, 1]
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([a, a])


def test_cached_free_block_is_evicted_when_reached() -> None:
    pool = BlockPool(num_blocks=4)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, 111)
    pool.cache_full_block(second, 222)
    pool.free_blocks([second, first])  # queue: 3, 2, 1
    assert pool.get_cached_block(111) is first
    assert _ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.get_cached_block(222) is None and second.block_hash is None
    assert pool.get_cached_block(111) is first


def test_touch_revives_cached_free_block_and_counts_refs() -> None:
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 7)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3 and block.ref_cnt == 0
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.free_queue_ids() == [2, 3]
    pool.touch([block])
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert pool.free_queue_ids() == [2, 3, 1]
    assert pool.get_cached_block(7) is block


def test_cache_full_block_keeps_first_block_for_a_hash() -> None:
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 5)
    pool.cache_full_block(b, 5)
    assert pool.get_cached_block(5) is a and b.block_hash is None
    pool.cache_full_block(a, 5)  # idempotent
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_block(a, 6)


def test_no_prefix_caching_registers_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_prefix_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 5)
    assert pool.get_cached_block(5) is None and block.block_hash is None


def test_reset_prefix_cache_needs_every_block_free_and_drops_hashes_and_next_tokens() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    for block, block_hash in zip(blocks, (11, 22), strict=True):
        pool.cache_full_block(block, block_hash)
    blocks[0].next_token = 7
    with pytest.raises(ValueError, match="2 blocks are still held"):
        pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() == 2
    assert (pool.get_cached_block(11), pool.get_cached_block(22)) == (None, None)
    assert [(b.block_hash, b.next_token) for b in blocks] == [(None, None), (None, None)]
    assert pool.num_free_blocks == 3

from __future__ import annotations

import pytest

from runtime.kv.manager import ComputedBlocks, KVCacheManager

BS = 4


def _refs(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.pool.block(i).ref_cnt for i in block_ids]


def test_first_allocation_hands_out_ids_from_one_and_counts_lookahead() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(10))
    assert manager.allocate_slots("a", tokens, 0, 10, num_lookahead_tokens=3) == [1, 2, 3, 4]
    # decode: 11 tokens, 10 computed, 1 new + 3 lookahead = 14 slots -> still 4 blocks
    assert manager.allocate_slots("a", tokens + [10], 10, 1, num_lookahead_tokens=3) == []
    # verify: 12 computed, 1 + 3 drafts new, 3 lookahead = 19 slots -> 5 blocks
    assert manager.allocate_slots("a", tokens + [10, 11, 12], 12, 4, 3) == [5]
    assert manager.block_ids("a") == [1, 2, 3, 4, 5]
    assert manager.num_free_blocks == 4
    assert manager.usage == 5 / 9


def test_prefix_hit_reuses_earlier_block_ids_and_counts_tokens() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    assert manager.allocate_slots("a", list(range(10)), 0, 10) == [1, 2, 3]
    prompt_b = list(range(8)) + [50, 51]
    hit = manager.get_computed_blocks(prompt_b)
    assert hit == ComputedBlocks([1, 2], 8)
    assert manager.allocate_slots("b", prompt_b, 8, 2, new_computed_block_ids=hit.block_ids) == [4]
    assert manager.block_ids("b") == [1, 2, 4]
    assert _refs(manager, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert (manager.hits_tokens, manager.queried_tokens) == (8, 20)


def test_hit_never_covers_the_whole_prompt() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    manager.allocate_slots("a", list(range(12)), 0, 12)  # 3 full blocks cached
    assert manager.get_computed_blocks(list(range(12))) == ComputedBlocks([1, 2], 8)
    assert manager.get_computed_blocks(list(range(8))) == ComputedBlocks([1], 4)
    assert manager.get_computed_blocks(list(range(9))) == ComputedBlocks([1, 2], 8)
    assert manager.get_computed_blocks(list(range(4))) == ComputedBlocks([], 0)
    assert manager.get_computed_blocks([]) == ComputedBlocks([], 0)
    assert manager.get_computed_blocks([0, 1, 2, 9, 9]) == ComputedBlocks([], 0)


def test_free_releases_tail_first_and_hits_revive_freed_blocks() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    assert manager.allocate_slots("a", prompt, 0, 9) == [1, 2, 3]
    manager.free("a")
    manager.free("a")  # unknown now: no-op
    assert manager.pool.free_queue_ids() == [4, 5, 3, 2, 1]
    hit = manager.get_computed_blocks(prompt)
    assert hit == ComputedBlocks([1, 2], 8)
    assert manager.allocate_slots("b", prompt, 8, 1, new_computed_block_ids=hit.block_ids) == [4]
    assert manager.block_ids("b") == [1, 2, 4]
    assert manager.pool.free_queue_ids() == [5, 3]


def test_lru_eviction_drops_least_recently_freed_cached_blocks_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    manager.allocate_slots("a", prompt, 0, 9)
    manager.free("a")  # queue 4, 5, 3, 2, 1
    assert manager.allocate_slots("c", [90 + i for i in range(9)], 0, 9) == [4, 5, 3]
    assert manager.allocate_slots("c", [90 + i for i in range(13)], 9, 4) == [2]
    assert manager.get_computed_blocks(prompt) == ComputedBlocks([1], 4)  # block 2 evicted


def test_returns_none_and_changes_nothing_when_short() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    manager.allocate_slots("a", list(range(9)), 0, 9)
    manager.free("a")  # 4 free, blocks 1 and 2 cache tokens 0..7
    prompt = list(range(9)) + [100 + i for i in range(7)]
    hit = manager.get_computed_blocks(prompt)
    assert hit == ComputedBlocks([1, 2], 8)
    # 16 + 4 lookahead = 5 blocks: 2 revived hits + 3 new > 4 free
    short = manager.allocate_slots("b", prompt, 8, 8, 4, new_computed_block_ids=hit.block_ids)
    assert short is None
    assert manager.pool.free_queue_ids() == [4, 3, 2, 1]
    assert _refs(manager, [1, 2, 3, 4]) == [0, 0, 0, 0]
    assert manager.get_computed_blocks(prompt) == hit
    assert (manager.hits_tokens, manager.queried_tokens) == (0, 9)
    with pytest.raises(ValueError, match="'b'"):
        manager.block_ids("b")
    assert manager.allocate_slots("b", prompt, 8, 8, 0, new_computed_block_ids=[1, 2]) == [4, 3]
    assert manager.block_ids("b") == [1, 2, 4, 3]
    assert manager.allocate_slots("b", prompt + [7], 16, 1) is None
    assert manager.block_ids("b") == [1, 2, 4, 3]


def test_chunked_prefill_caches_each_full_chunk() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))
    assert manager.allocate_slots("a", prompt, 0, 4) == [1]
    assert manager.get_computed_blocks(prompt) == ComputedBlocks([1], 4)
    assert manager.allocate_slots("a", prompt, 4, 3) == [2]  # 7 tokens: block 2 not full yet
    assert manager.get_computed_blocks(prompt) == ComputedBlocks([1], 4)
    assert manager.allocate_slots("a", prompt, 7, 3) == [3]
    assert manager.get_computed_blocks(prompt) == ComputedBlocks([1, 2], 8)


def test_draft_tokens_in_lookahead_slots_are_never_cached() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    verified = list(range(6))  # 5 prefilled + 1 sampled
    manager.allocate_slots("a", verified[:5], 0, 5, num_lookahead_tokens=3)
    # verify step: 1 verified + 3 drafts at positions 5..8; only 6 tokens are verified
    assert manager.allocate_slots("a", verified, 5, 4, num_lookahead_tokens=3) == [3]
    assert manager.get_computed_blocks(verified + [70, 71, 72]) == ComputedBlocks([1], 4)
    accepted = verified + [70, 71, 72]  # 2 drafts accepted + bonus token
    manager.allocate_slots("a", accepted, 9, 1, num_lookahead_tokens=3)
    assert manager.get_computed_blocks(accepted + [0]) == ComputedBlocks([1, 2], 8)


def test_shared_blocks_stay_referenced_after_one_owner_frees() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    manager.allocate_slots("a", list(range(9)), 0, 9)
    manager.allocate_slots("b", list(range(9)), 8, 1, new_computed_block_ids=[1, 2])
    manager.free("a")
    assert _refs(manager, [1, 2, 3, 4]) == [1, 1, 0, 1]
    assert manager.pool.free_queue_ids() == [5, 6, 7, 8, 9, 3]
    manager.free("b")
    assert manager.pool.free_queue_ids() == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert manager.usage == 0.0


def test_without_prefix_caching_nothing_is_cached_or_counted() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    manager.allocate_slots("a", list(range(9)), 0, 9)
    assert manager.get_computed_blocks(list(range(9))) == ComputedBlocks([], 0)
    assert manager.pool.block(1).block_hash is None
    assert (manager.hits_tokens, manager.queried_tokens) == (0, 0)


def test_rejects_bad_hits_and_counts() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    manager.allocate_slots("a", list(range(9)), 0, 9)
    with pytest.raises(ValueError, match="first allocation"):
        manager.allocate_slots("a", list(range(9)), 8, 1, new_computed_block_ids=[1])
    with pytest.raises(ValueError, match="no longer caches block 1"):
        manager.allocate_slots("b", list(range(9)), 8, 1, new_computed_block_ids=[1, 3])
    with pytest.raises(ValueError, match="computed tokens"):
        manager.allocate_slots("b", list(range(9)), 4, 5, new_computed_block_ids=[1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        manager.allocate_slots("b", list(range(9)), 0, -1)
    assert manager.block_ids("a") == [1, 2, 3] and manager.num_free_blocks == 6


def test_with_match_next_token_a_hit_ends_where_the_token_after_it_differs() -> None:
    """A drafter's KV at a block's last position was written with the token after the block:
    the hit keeps its last block only where that token is the same."""
    manager = KVCacheManager(num_blocks=12, block_size=BS, match_next_token=True)
    manager.allocate_slots("a", list(range(8)) + [7, 7], 0, 10)  # blocks 1, 2 cached
    assert manager.get_computed_blocks(list(range(8)) + [9, 10]) == ComputedBlocks([1], 4)
    assert manager.get_computed_blocks(list(range(8)) + [7, 10]) == ComputedBlocks([1, 2], 8)
    # a block full of the prompt: its next token comes with a later allocation, or at free
    manager.allocate_slots("b", list(range(20, 28)), 0, 8)  # blocks 4, 5 cached
    assert manager.get_computed_blocks(list(range(20, 28)) + [5, 6]) == ComputedBlocks([4], 4)
    manager.free("b", list(range(20, 28)) + [5])
    assert manager.get_computed_blocks(list(range(20, 28)) + [5, 6]) == ComputedBlocks([4, 5], 8)
    assert manager.get_computed_blocks(list(range(20, 28)) + [6, 5]) == ComputedBlocks([4], 4)
    plain = KVCacheManager(num_blocks=12, block_size=BS)
    plain.allocate_slots("a", list(range(8)) + [7, 7], 0, 10)
    assert plain.get_computed_blocks(list(range(8)) + [9, 10]) == ComputedBlocks([1, 2], 8)


def test_free_with_incomplete_positions_uncaches_the_blocks_holding_them() -> None:
    """Blocks the request cached that hold positions >= num_complete leave the prefix cache;
    earlier ones, and blocks a hit brought, stay."""
    manager = KVCacheManager(num_blocks=12, block_size=BS)
    manager.allocate_slots("a", list(range(9)), 0, 9)  # blocks 1, 2 cached
    hit = manager.get_computed_blocks(list(range(4)) + [50, 51, 52, 53, 54])
    assert hit == ComputedBlocks([1], 4)
    b = list(range(4)) + [50, 51, 52, 53, 54, 55, 56, 57, 58]
    manager.allocate_slots("b", b, 4, 9, new_computed_block_ids=hit.block_ids)  # 4, 5 cached
    manager.free("b", b, num_complete=2)  # inside the hit: only its own blocks go
    assert manager.get_computed_blocks(b + [0]) == ComputedBlocks([1], 4)
    manager.free("a", list(range(9)), num_complete=6)
    assert manager.get_computed_blocks(list(range(9))) == ComputedBlocks([1], 4)


def test_blocks_with_incomplete_kv_are_not_noted_so_no_hit_reaches_them() -> None:
    manager = KVCacheManager(num_blocks=12, block_size=BS, match_next_token=True)
    tokens = list(range(13))
    manager.allocate_slots("a", tokens, 0, 13, num_complete=5)  # blocks 1-3 cached
    # block 0 (positions 0-3) is complete and noted; block 1 holds positions 5-7: not yet
    assert manager.get_computed_blocks(tokens + [0]) == ComputedBlocks([1], 4)
    manager.allocate_slots("a", tokens + [13], 13, 1)  # the rows were written since
    assert manager.get_computed_blocks(tokens + [0]) == ComputedBlocks([1, 2, 3], 12)


def test_every_hit_block_is_checked_as_a_chain_may_mix_requests_blocks() -> None:
    """A caches blocks 0 and 1 (block 1 followed by 50); B has block 1's tokens too but 60 after
    them, so its hit ends at block 0, its own block 1 stays uncached (A's holds the hash) and it
    caches block 2 behind it. W = B's text: block 2 (B's) matches, but the block 1 it would take
    is A's, written with 50 after it: the hit ends at block 0."""
    manager = KVCacheManager(num_blocks=20, block_size=BS, match_next_token=True)
    prefix = list(range(10, 18))
    manager.allocate_slots("a", prefix + [50, 51], 0, 10)
    b = prefix + [60, 61, 62, 63, 64]
    hit = manager.get_computed_blocks(b)
    assert hit == ComputedBlocks([1], 4)
    manager.allocate_slots("b", b, 4, 9, new_computed_block_ids=hit.block_ids)
    manager.free("b", b + [65])
    manager.free("a", prefix + [50, 51])
    assert manager.get_computed_blocks(b + [65, 66]) == ComputedBlocks([1], 4)
    assert manager.get_computed_blocks(prefix + [50, 51]) == ComputedBlocks([1, 2], 8)


def test_reset_prefix_cache_forgets_every_cached_block_between_requests_only() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    manager.allocate_slots("a", prompt, 0, 9)  # blocks 1 and 2 full, so cached
    with pytest.raises(ValueError, match="while 1 requests hold blocks"):
        manager.reset_prefix_cache()
    manager.free("a")
    assert manager.get_computed_blocks(prompt) == ComputedBlocks([1, 2], 8)
    assert manager.reset_prefix_cache() == 2
    assert manager.get_computed_blocks(prompt) == ComputedBlocks([], 0)
    assert [manager.pool.block(i).block_hash for i in range(1, 6)] == [None] * 5
    assert manager.pool.free_queue_ids() == [4, 5, 3, 2, 1]  # the order of eviction is kept
    assert manager.reset_prefix_cache() == 0
    # the same prompt again computes and caches its blocks anew
    assert manager.allocate_slots("b", prompt, 0, 9) == [4, 5, 3]
    manager.free("b")
    assert manager.get_computed_blocks(prompt) == ComputedBlocks([4, 5], 8)

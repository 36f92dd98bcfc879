from __future__ import annotations

import pytest
import torch

from runtime.kv.cache import allocate_kv_caches, compute_slot_mapping
from runtime.kv.groups import make_kv_cache_config
from runtime.kv.spec import AttentionSpec

FULL = AttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=4)
WINDOW = AttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=4, sliding_window=8)


def test_one_zeroed_paged_tensor_per_layer() -> None:
    # pages: 512 + 256 + 512 = 1280 bytes per block -> 5 blocks
    config = make_kv_cache_config({"l0": FULL, "l1": WINDOW, "l2": FULL}, memory_bytes=6400)
    caches = allocate_kv_caches(config, torch.float32, torch.device("cpu"))
    assert list(caches) == ["l0", "l2", "l1"]
    assert caches["l0"].shape == (2, 5, 4, 2, 8)
    assert caches["l1"].shape == (2, 5, 4, 1, 8)
    assert all(not cache.any() for cache in caches.values())
    assert caches["l0"].data_ptr() != caches["l2"].data_ptr()
    assert sum(c.numel() * c.element_size() for c in caches.values()) == 6400


def test_dtype_must_match_the_spec_it_was_sized_for() -> None:
    config = make_kv_cache_config({"l0": FULL}, memory_bytes=2048)
    with pytest.raises(ValueError, match="sized for 4"):
        allocate_kv_caches(config, torch.float16, torch.device("cpu"))


def test_slot_mapping_worked_example() -> None:
    assert compute_slot_mapping([3, 7], [0, 1, 5], 4) == [12, 13, 29]
    assert compute_slot_mapping([3, 7], [3, 4, 7], 4) == [15, 28, 31]
    assert compute_slot_mapping([2], [], 4) == []


def test_slot_mapping_rejects_positions_outside_the_table() -> None:
    with pytest.raises(ValueError, match="position 8"):
        compute_slot_mapping([3, 7], [8], 4)
    with pytest.raises(ValueError, match="position -1"):
        compute_slot_mapping([3, 7], [-1], 4)

from __future__ import annotations

import pytest

from runtime.kv.groups import (
    KVCacheConfig,
    KVCacheGroup,
    KVCacheGroupError,
    draft_layer_name,
    group_layers,
    make_kv_cache_config,
    target_layer_name,
    validate_same_kv_cache_group,
)
from runtime.kv.spec import AttentionSpec

FULL = AttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=2)  # 256 B/page
WINDOW = AttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=2, sliding_window=8)
WIDE = AttentionSpec(block_size=4, num_kv_heads=4, head_size=8, dtype_bytes=2)  # 512 B/page


def _target_and_drafts(draft_specs: list[AttentionSpec]) -> dict[str, AttentionSpec]:
    specs = {target_layer_name(i): FULL for i in range(2)}
    specs.update({draft_layer_name(2, i): spec for i, spec in enumerate(draft_specs)})
    return specs


def test_layer_names_offset_drafts_past_target() -> None:
    assert target_layer_name(0) == "layers.0"
    assert draft_layer_name(30, 0) == "layers.30"
    assert draft_layer_name(30, 2) == "layers.32"


def test_group_layers_by_equal_spec_in_first_appearance_order() -> None:
    groups = group_layers({"c": WINDOW, "a": FULL, "b": WINDOW, "d": FULL})
    assert groups == (KVCacheGroup(WINDOW, ("c", "b")), KVCacheGroup(FULL, ("a", "d")))


def test_config_layer_names_and_group_of() -> None:
    config = make_kv_cache_config({"x": FULL, "y": WINDOW, "z": FULL}, memory_bytes=10_000)
    assert config.layer_names == ("x", "z", "y")
    assert [config.group_of(n) for n in ("x", "y", "z")] == [0, 1, 0]
    with pytest.raises(ValueError, match="'nope'"):
        config.group_of("nope")


def test_num_blocks_counts_every_layer_including_drafts() -> None:
    # 3 target pages of 256 B + 1 draft page of 512 B = 1280 B per block.
    specs = {"layers.0": FULL, "layers.1": FULL, "layers.2": FULL, "layers.3": WIDE}
    config = make_kv_cache_config(specs, memory_bytes=12_900, draft_layer_names=["layers.3"])
    assert config.num_blocks == 10
    assert config.draft_layer_names == ("layers.3",)
    assert make_kv_cache_config(specs, memory_bytes=2560).num_blocks == 2


def test_too_small_budget_says_bytes_per_block_and_minimum() -> None:
    with pytest.raises(ValueError) as err:
        make_kv_cache_config({"a": FULL, "b": FULL}, memory_bytes=1000)
    message = str(err.value)
    assert "1000 bytes" in message and "512 bytes" in message and "1024 bytes" in message


def test_make_config_rejects_unknown_draft_layer_and_duplicates() -> None:
    with pytest.raises(ValueError, match="layers.9"):
        make_kv_cache_config({"layers.0": FULL}, 10_000, draft_layer_names=["layers.9"])
    with pytest.raises(ValueError, match="more than one place: a"):
        KVCacheConfig(4, (KVCacheGroup(FULL, ("a",)), KVCacheGroup(WINDOW, ("a",))))


def test_same_spec_drafter_passes() -> None:
    specs = _target_and_drafts([FULL, FULL, FULL])
    config = make_kv_cache_config(specs, 100_000, draft_layer_names=["layers.2", "layers.3",
                                                                      "layers.4"])
    assert len(config.groups) == 1
    validate_same_kv_cache_group(config)
    validate_same_kv_cache_group(config, ["layers.3"])


def test_drafter_with_a_sliding_window_layer_fails_naming_layers_and_groups() -> None:
    specs = _target_and_drafts([FULL, WINDOW, FULL])
    drafts = ["layers.2", "layers.3", "layers.4"]
    config = make_kv_cache_config(specs, 100_000, draft_layer_names=drafts)
    with pytest.raises(KVCacheGroupError) as err:
        validate_same_kv_cache_group(config)
    message = str(err.value)
    # the cache's names and the drafter's own layer indices (its checkpoint's layers.0, ...)
    assert "layers.2 (draft layer 0) -> group 0" in message
    assert "layers.3 (draft layer 1) -> group 1" in message
    assert "layers.4 (draft layer 2) -> group 0" in message
    assert "sliding_window=8" in message
    assert isinstance(err.value, ValueError)


def test_drafter_all_sliding_window_is_one_group_and_passes() -> None:
    config = make_kv_cache_config(_target_and_drafts([WINDOW, WINDOW]), 100_000,
                                  draft_layer_names=["layers.2", "layers.3"])
    validate_same_kv_cache_group(config)


def test_missing_draft_layer_and_no_drafts() -> None:
    config = make_kv_cache_config(_target_and_drafts([FULL]), 100_000)
    validate_same_kv_cache_group(config)  # no draft layers: nothing to check
    with pytest.raises(KVCacheGroupError, match="missing from the KV cache config: layers.7"):
        validate_same_kv_cache_group(config, ["layers.2", "layers.7"])

from __future__ import annotations

import pytest

from runtime.kv.spec import AttentionSpec


def test_page_size_counts_k_and_v_for_one_layer() -> None:
    spec = AttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=2)
    assert spec.page_size_bytes == 2 * 4 * 2 * 8 * 2 == 256


def test_sliding_window_does_not_change_page_size_but_changes_equality() -> None:
    full = AttentionSpec(4, 2, 8, 2)
    windowed = AttentionSpec(4, 2, 8, 2, sliding_window=8)
    assert windowed.page_size_bytes == full.page_size_bytes
    assert full != windowed
    assert full == AttentionSpec(4, 2, 8, 2, None)
    assert len({full, windowed, AttentionSpec(4, 2, 8, 2)}) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"num_kv_heads": 0},
        {"head_size": -1},
        {"dtype_bytes": 0},
        {"sliding_window": 0},
    ],
)
def test_rejects_non_positive_fields(kwargs: dict[str, int]) -> None:
    fields = {"block_size": 4, "num_kv_heads": 2, "head_size": 8, "dtype_bytes": 2}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        AttentionSpec(**fields)

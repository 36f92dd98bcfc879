"""KV cache tensors and the token-position -> cache-slot mapping (the one torch module here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.kv.groups import KVCacheConfig


def allocate_kv_caches(
    kv_cache_config: KVCacheConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """One zeroed cache tensor per layer name, in kv_cache_config.layer_names order.

    Each is [2, num_blocks, block_size, num_kv_heads, head_size]: index 0 holds K, index 1 holds
    V, and cache[0] / cache[1] are each the [num_blocks, block_size, nheads_k, head_dim] paged
    layout flash-attn expects. ValueError if dtype's size differs from a spec's dtype_bytes (the
    block count was computed from it).
    """
    caches: dict[str, torch.Tensor] = {}
    for group in kv_cache_config.groups:
        spec = group.spec
        if dtype.itemsize != spec.dtype_bytes:
            raise ValueError(
                f"dtype {dtype} has {dtype.itemsize} bytes per element but layers "
                f"{', '.join(group.layer_names)} were sized for {spec.dtype_bytes}"
            )
        shape = (2, kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        for name in group.layer_names:
            caches[name] = torch.zeros(shape, dtype=dtype, device=device)
    return {name: caches[name] for name in kv_cache_config.layer_names}


def compute_slot_mapping(
    block_table: Sequence[int], positions: Sequence[int], block_size: int
) -> list[int]:
    """Flat cache slot of each token position: the slot index into a cache viewed as
    [num_blocks * block_size, ...].

        slot = block_table[pos // block_size] * block_size + pos % block_size

    Worked example, block_size 4, block_table [3, 7]:
        pos 0 -> block 3, offset 0 -> slot 12
        pos 1 -> block 3, offset 1 -> slot 13
        pos 5 -> block 7, offset 1 -> slot 29
    so compute_slot_mapping([3, 7], [0, 1, 5], 4) == [12, 13, 29].
    ValueError for a negative position or one past the block table.
    """
    slots: list[int] = []
    for pos in positions:
        block_index, offset = divmod(pos, block_size)
        if pos < 0 or block_index >= len(block_table):
            raise ValueError(
                f"position {pos} is outside the block table ({len(block_table)} blocks of "
                f"{block_size} slots)"
            )
        slots.append(block_table[block_index] * block_size + offset)
    return slots

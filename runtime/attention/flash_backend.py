"""flash-attn over the same paged cache (CUDA only). Imported lazily: flash-attn is optional.

flash-attn 2's paged KV needs the cache block size to be a multiple of 256; the engine picks
block_size 256 when this backend is selected.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.attention.metadata import AttentionMetadata
from runtime.attention.torch_backend import write_kv

FLASH_BLOCK_SIZE = 256


def load_flash_attn() -> Any | None:
    """The flash_attn module, or None when it is not installed or cannot run here."""
    if not torch.cuda.is_available():
        return None
    try:
        import flash_attn  # noqa: PLC0415  (optional dependency, imported lazily)
    except ImportError:
        return None
    return flash_attn


class FlashAttentionBackend:
    name = "flash"

    def __init__(self, scale: float, sliding_window: int | None = None) -> None:
        module = load_flash_attn()
        if module is None:
            raise RuntimeError("flash-attn is not importable; install the 'gpu' extra on CUDA")
        self._varlen = module.flash_attn_varlen_func
        self.scale = scale
        self.window = (sliding_window - 1, 0) if sliding_window else (-1, -1)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        write_kv(kv_cache, key, value, md.slot_mapping)
        cu_k = torch.zeros(md.num_seqs + 1, dtype=torch.int32, device=query.device)
        cu_k[1:] = torch.cumsum(md.seq_lens, 0)
        return self._varlen(
            query, kv_cache[0], kv_cache[1],
            cu_seqlens_q=md.query_start_loc, cu_seqlens_k=cu_k,
            max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len,
            softmax_scale=self.scale, causal=True, window_size=self.window,
            block_table=md.block_table,
        )

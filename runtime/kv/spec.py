"""The per-layer attention spec that decides the KV cache page layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    """How one attention layer stores its keys and values in the paged cache.

    Two layers whose specs are equal can share one KV cache group (one block table).
    sliding_window: None means full attention; otherwise each token attends to at most
    this many previous tokens (itself included).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size", "dtype_bytes"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"AttentionSpec.{name} must be >= 1, got {value}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"AttentionSpec.sliding_window must be None or >= 1, got {self.sliding_window}"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in ONE layer: K and V, each [block_size, num_kv_heads, head_size].

        Example: block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=2 -> 2*4*2*8*2 = 256.
        """
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

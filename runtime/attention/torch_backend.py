"""Portable paged attention in plain torch (CPU and CUDA). Correct first, then reasonably fast.

Sequences are attended in a few padded batches: each sequence's K/V are gathered through its block
table and masked. Sequences are bucketed by query length (1, 2, 3-4, 5-8, 9-16, ...), so decode and
verification rows share one batch and padding never more than doubles a prefill chunk's cost.
Index tensors and masks depend only on the metadata, so they are built once per forward pass
(by the first layer) and kept in metadata.derived for the other layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.attention.metadata import AttentionMetadata


def write_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Mutates kv_cache: stores each token's K and V at its slot."""
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


# Masked 16-bit attention on Hopper would go to cuDNN's kernel, which builds a graph for every new
# shape (hundreds of ms each) and costs ~0.1-0.3 ms of host time per call even when cached. Paged
# batches change shape nearly every step (rows per length bucket, blocks gathered), verification
# and draft steps most of all: on the H200 a batch-16 k-2 step took ~150 ms in a fresh engine
# against ~24 ms for a plain one. The memory-efficient kernel takes any mask and compiles nothing
# per shape; it does not take enable_gqa with a mask, so KV heads are repeated for it.
_CUDA_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend_without_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """scaled_dot_product_attention of q [b, heads, tq, d] over k, v [b, kv_heads, tk, d] under
    a bool mask, on the memory-efficient kernel (or plain math where it cannot run)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(_CUDA_KERNELS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _Batched(NamedTuple):
    """Queries of one length bucket, padded to width_q tokens each; padding repeats a row's last
    token."""

    num_rows: int
    width_q: int
    query_index: torch.Tensor  # [num_rows * width_q] token index of each padded query slot
    blocks: torch.Tensor  # [num_rows * num_blocks] each row's block table, 0-padded
    num_blocks: int  # blocks gathered per row: keys 0 .. num_blocks * block_size - 1
    mask: torch.Tensor  # [num_rows, 1, width_q, num_blocks * block_size] bool
    keep: torch.Tensor  # [num_short_tokens] padded rows that hold real tokens
    dest: torch.Tensor  # [num_short_tokens] their token index in the step


def set_decode_plan(md: AttentionMetadata, block_size: int, num_blocks: int) -> None:
    """Mutates md.derived: the plan of a step where every sequence has one query token, built
    from md's own tensors with tensor ops only (no host lists), so a CUDA graph can record it
    (runtime.cuda_graphs). Sequence i sees keys 0 .. seq_lens[i] - 1 of the first num_blocks
    blocks of its table. Full attention only (no sliding window)."""
    rows = md.block_table.shape[0]
    device = md.block_table.device
    every = torch.arange(rows, device=device)
    keys = torch.arange(num_blocks * block_size, device=device)
    mask = (keys.view(1, -1) < md.seq_lens.view(-1, 1)).view(rows, 1, 1, -1)
    blocks = md.block_table[:, :num_blocks].long().reshape(-1)
    md.derived[_plan_key(block_size, None)] = [
        _Batched(rows, 1, every, blocks, num_blocks, mask, every, every)]


def _plan_key(block_size: int, sliding_window: int | None) -> str:
    return f"torch/{block_size}/{sliding_window}"


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, scale: float, sliding_window: int | None = None) -> None:
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        write_kv(kv_cache, key, value, md.slot_mapping)
        out = torch.empty_like(query)
        self._attend_batches(query, kv_cache, self._plan(md, kv_cache.shape[2], query.device), out)
        return out

    def _attend_batches(self, query: torch.Tensor, kv_cache: torch.Tensor,
                        batches: list[_Batched], out: torch.Tensor) -> None:
        """Mutates out: writes the attention output of every query token in `batches`."""
        for batched in batches:
            q = query.index_select(0, batched.query_index)
            q = q.view(batched.num_rows, batched.width_q, *query.shape[1:]).transpose(1, 2)
            o = self._attend(q, kv_cache, batched)
            o = o.transpose(1, 2).reshape(-1, *query.shape[1:])
            out.index_copy_(0, batched.dest, o.index_select(0, batched.keep))

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, b: _Batched) -> torch.Tensor:
        """q [rows, heads, width_q, d] -> [rows, heads, width_q, d], over whole blocks gathered
        with one index_select per K and V (rows of block_size * kv_heads * d contiguous floats;
        much cheaper than gathering single slots)."""
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        shape = (b.num_rows, b.num_blocks * block_size, heads, dim)
        k = kv_cache[0].view(num_blocks, -1).index_select(0, b.blocks).view(shape)
        v = kv_cache[1].view(num_blocks, -1).index_select(0, b.blocks).view(shape)
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        if q.is_cuda:
            return attend_without_cudnn(q, k, v, b.mask, self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=b.mask, scale=self.scale,
                                              enable_gqa=True)

    def _plan(self, md: AttentionMetadata, block_size: int, device: torch.device
              ) -> list[_Batched]:
        key = _plan_key(block_size, self.sliding_window)
        if key not in md.derived:  # padded batches of the sequences, bucketed by query length
            buckets: dict[int, list[int]] = {}
            for i in range(md.num_seqs):
                buckets.setdefault((md.query_lens[i] - 1).bit_length(), []).append(i)
            md.derived[key] = [self._batch(md, rows, block_size, device)
                               for _, rows in sorted(buckets.items())]
        return md.derived[key]

    def _batch(self, md: AttentionMetadata, rows: list[int], block_size: int,
               device: torch.device) -> _Batched:
        q_lens = [md.query_lens[i] for i in rows]
        kv_lens = [md.seq_lens_host[i] for i in rows]
        width_q, num_kv = max(q_lens), max(kv_lens)
        starts = [md.query_starts[i] for i in rows]
        query_index = [s + min(j, n - 1)
                       for s, n in zip(starts, q_lens, strict=True) for j in range(width_q)]
        keep = [r * width_q + j for r, n in enumerate(q_lens) for j in range(n)]
        dest = [s + j for s, n in zip(starts, q_lens, strict=True) for j in range(n)]
        num_blocks = -(-num_kv // block_size)
        blocks = md.block_table[rows][:, :num_blocks].long().reshape(-1)
        return _Batched(
            len(rows), width_q, torch.tensor(query_index, device=device), blocks, num_blocks,
            self._mask(q_lens, kv_lens, width_q, num_blocks * block_size, device),
            torch.tensor(keep, device=device), torch.tensor(dest, device=device))

    def _mask(self, q_lens: list[int], kv_lens: list[int], width_q: int, width_kv: int,
              device: torch.device) -> torch.Tensor:
        """[b, 1, width_q, width_kv] bool: query i of a sequence sits at position
        kv_len - q_len + i and sees keys 0..that position (within the window, if any)."""
        qi = torch.arange(width_q, device=device).view(1, -1, 1)
        kj = torch.arange(width_kv, device=device).view(1, 1, -1)
        offset = torch.tensor([k - q for q, k in zip(q_lens, kv_lens, strict=True)], device=device)
        qpos = offset.view(-1, 1, 1) + qi
        mask = kj <= qpos
        if self.sliding_window is not None:
            mask &= kj > qpos - self.sliding_window
        return mask.unsqueeze(1)

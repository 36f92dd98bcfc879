"""Portable paged attention in plain torch (CPU and CUDA). Correct first, then reasonably fast.

Sequences with short queries (decode, verification of a few draft tokens) are attended together:
their K/V are gathered through the block table into one padded batch and masked. Long queries
(prefill chunks) are attended one sequence at a time so padding never multiplies their cost.
Index tensors and masks depend only on the metadata, so they are built once per forward pass
(by the first layer) and kept in metadata.derived for the other layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from runtime.attention.metadata import AttentionMetadata

# Queries up to this many tokens go into the padded batch; longer ones run alone.
BATCHED_QUERY_MAX = 16


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


class _Batched(NamedTuple):
    """Short queries, padded to width_q tokens each; padding repeats a row's last token."""

    num_rows: int
    width_q: int
    query_index: torch.Tensor  # [num_rows * width_q] token index of each padded query slot
    slots: torch.Tensor  # [num_rows, num_kv] flat cache slots of each row's keys
    mask: torch.Tensor  # [num_rows, 1, width_q, num_kv] bool
    keep: torch.Tensor  # [num_short_tokens] padded rows that hold real tokens
    dest: torch.Tensor  # [num_short_tokens] their token index in the step


class _Single(NamedTuple):
    start: int
    num_tokens: int
    slots: torch.Tensor  # [kv_len] flat cache slots of the sequence's keys
    mask: torch.Tensor  # [1, 1, num_tokens, kv_len] bool


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
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
        batched, singles = self._plan(md, block_size, query.device)
        out = torch.empty_like(query)
        if batched is not None:
            q = query.index_select(0, batched.query_index)
            q = q.view(batched.num_rows, batched.width_q, *query.shape[1:]).transpose(1, 2)
            o = self._attend(q, flat, batched.slots, batched.mask)
            o = o.transpose(1, 2).reshape(-1, *query.shape[1:])
            out.index_copy_(0, batched.dest, o.index_select(0, batched.keep))
        for s in singles:
            q = query[s.start:s.start + s.num_tokens].unsqueeze(0).transpose(1, 2)
            o = self._attend(q, flat, s.slots.unsqueeze(0), s.mask)
            out[s.start:s.start + s.num_tokens] = o.transpose(1, 2)[0]
        return out

    def _attend(self, q: torch.Tensor, flat: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """q [b, heads, width_q, d]; keys at slots [b, num_kv] -> [b, heads, width_q, d]."""
        b, n = slots.shape
        kv = flat[:, slots.view(-1)].view(2, b, n, *flat.shape[2:]).transpose(2, 3)
        return F.scaled_dot_product_attention(q, kv[0].to(q.dtype), kv[1].to(q.dtype),
                                              attn_mask=mask, scale=self.scale, enable_gqa=True)

    def _plan(self, md: AttentionMetadata, block_size: int, device: torch.device
              ) -> tuple[_Batched | None, list[_Single]]:
        key = f"torch/{block_size}/{self.sliding_window}"
        if key not in md.derived:
            md.derived[key] = self._build_plan(md, block_size, device)
        return md.derived[key]

    def _build_plan(self, md: AttentionMetadata, block_size: int, device: torch.device
                    ) -> tuple[_Batched | None, list[_Single]]:
        short = [i for i, n in enumerate(md.query_lens) if n <= BATCHED_QUERY_MAX]
        singles = [
            _Single(md.query_starts[i], n,
                    self._slots(md, [i], md.seq_lens_host[i], block_size, device)[0],
                    self._mask([n], [md.seq_lens_host[i]], n, md.seq_lens_host[i], device))
            for i, n in enumerate(md.query_lens) if n > BATCHED_QUERY_MAX]
        if not short:
            return None, singles
        q_lens = [md.query_lens[i] for i in short]
        kv_lens = [md.seq_lens_host[i] for i in short]
        width_q, num_kv = max(q_lens), max(kv_lens)
        starts = [md.query_starts[i] for i in short]
        query_index = [s + min(j, n - 1) for s, n in zip(starts, q_lens) for j in range(width_q)]
        keep = [r * width_q + j for r, n in enumerate(q_lens) for j in range(n)]
        dest = [s + j for s, n in zip(starts, q_lens) for j in range(n)]
        batched = _Batched(
            len(short), width_q, torch.tensor(query_index, device=device),
            self._slots(md, short, num_kv, block_size, device),
            self._mask(q_lens, kv_lens, width_q, num_kv, device),
            torch.tensor(keep, device=device), torch.tensor(dest, device=device))
        return batched, singles

    def _slots(self, md: AttentionMetadata, rows: list[int], num_kv: int, block_size: int,
               device: torch.device) -> torch.Tensor:
        """[len(rows), num_kv] flat cache slot of key j of each row (block table lookup).
        Example, block_size 4, table [7, 2]: keys 0..5 -> slots [28, 29, 30, 31, 8, 9]."""
        j = torch.arange(num_kv, device=device)
        table = md.block_table[rows].long()  # [rows, max_blocks]
        blocks = table[:, (j // block_size).clamp(max=table.shape[1] - 1)]
        return blocks * block_size + j % block_size

    def _mask(self, q_lens: list[int], kv_lens: list[int], width_q: int, width_kv: int,
              device: torch.device) -> torch.Tensor:
        """[b, 1, width_q, width_kv] bool: query i of a sequence sits at position
        kv_len - q_len + i and sees keys 0..that position (within the window, if any)."""
        qi = torch.arange(width_q, device=device).view(1, -1, 1)
        kj = torch.arange(width_kv, device=device).view(1, 1, -1)
        offset = torch.tensor([k - q for q, k in zip(q_lens, kv_lens)], device=device)
        qpos = offset.view(-1, 1, 1) + qi
        mask = kj <= qpos
        if self.sliding_window is not None:
            mask &= kj > qpos - self.sliding_window
        return mask.unsqueeze(1)

"""Portable paged attention in plain torch (CPU and CUDA). Correct first, then reasonably fast.

Sequences with short queries (decode, verification of a few draft tokens) are attended together:
their K/V are gathered through the block table into one padded batch and masked. Long queries
(prefill chunks) are attended one sequence at a time so padding never multiplies their cost.
"""

from __future__ import annotations

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
        short = [i for i, n in enumerate(md.query_lens) if n <= BATCHED_QUERY_MAX]
        if short:
            self._batched(query, kv_cache, md, short, out)
        start = 0
        for i, n in enumerate(md.query_lens):
            if n > BATCHED_QUERY_MAX:
                out[start:start + n] = self._one(query[start:start + n], kv_cache, md, i)
            start += n
        return out

    def _mask(self, q_len: torch.Tensor, kv_len: torch.Tensor, width_q: int,
              width_kv: int, device: torch.device) -> torch.Tensor:
        """[b, 1, width_q, width_kv] bool: query i of a sequence sits at position
        kv_len - q_len + i and sees keys 0..that position (within the window, if any)."""
        qi = torch.arange(width_q, device=device).view(1, -1, 1)
        kj = torch.arange(width_kv, device=device).view(1, 1, -1)
        qpos = (kv_len - q_len).view(-1, 1, 1) + qi
        mask = kj <= qpos
        if self.sliding_window is not None:
            mask &= kj > qpos - self.sliding_window
        return mask.unsqueeze(1)

    def _gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V for the given block tables: [b, num_kv_heads, num_blocks * block_size, head]."""
        blocks = kv_cache[:, block_table[:, :num_blocks].long()]  # [2, b, nb, bs, h, d]
        _, b, nb, bs, h, d = blocks.shape
        kv = blocks.reshape(2, b, nb * bs, h, d).transpose(2, 3)
        return kv[0], kv[1]

    def _batched(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                 rows: list[int], out: torch.Tensor) -> None:
        device = query.device
        block_size = kv_cache.shape[2]
        q_lens = [md.query_lens[i] for i in rows]
        width_q = max(q_lens)
        max_kv = max(md.seq_lens_host[i] for i in rows)
        nb = -(-max_kv // block_size)
        starts = md.query_starts
        # token index of (row r, query i); padded query slots repeat the row's last token
        index = [starts[i] + min(j, n - 1) for i, n in zip(rows, q_lens) for j in range(width_q)]
        index_t = torch.tensor(index, device=device)
        q = query.index_select(0, index_t).view(len(rows), width_q, *query.shape[1:])
        k, v = self._gather(kv_cache, md.block_table[rows], nb)
        rows_t = torch.tensor(rows, device=device)
        mask = self._mask(torch.tensor(q_lens, device=device), md.seq_lens[rows_t].long(),
                          width_q, nb * block_size, device)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype),
                                           attn_mask=mask, scale=self.scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(len(rows) * width_q, *query.shape[1:])
        keep = [r * width_q + j for r, n in enumerate(q_lens) for j in range(n)]
        dest = [starts[i] + j for i, n in zip(rows, q_lens) for j in range(n)]
        out[torch.tensor(dest, device=device)] = o[torch.tensor(keep, device=device)]

    def _one(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, i: int
             ) -> torch.Tensor:
        n, kv_len = q.shape[0], md.seq_lens_host[i]
        block_size = kv_cache.shape[2]
        nb = -(-kv_len // block_size)
        k, v = self._gather(kv_cache, md.block_table[i:i + 1], nb)
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        mask = self._mask(torch.tensor([n]), torch.tensor([kv_len]), n, kv_len, q.device)
        o = F.scaled_dot_product_attention(q.unsqueeze(0).transpose(1, 2), k.to(q.dtype),
                                           v.to(q.dtype), attn_mask=mask.to(q.device),
                                           scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2)[0]


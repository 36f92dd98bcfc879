"""The one attention-metadata dataclass every backend reads.

A step's query tokens from all sequences are flattened into one [num_tokens] batch. Worked example,
two sequences: seq A has 5 tokens cached and 3 new ones, seq B has 0 cached and 2 new, block_size 4:

    query_lens      = [3, 2]         seq_lens = [8, 2]      (cached + new)
    query_start_loc = [0, 3, 5]      (cu_seqlens_q)
    positions       = [5, 6, 7, 0, 1]
    block_table     = [[7, 9], [3, 0]]   (0 = the null block, padding)
    slot_mapping    = [9*4+1, 9*4+2, 9*4+3, 3*4+0, 3*4+1] = [37, 38, 39, 12, 13]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class AttentionMetadata:
    """Built once per forward pass (one per draft step for the drafter) and shared by every layer
    that reads it: layers receive a dict[layer_name, AttentionMetadata] whose values are the same
    object. eq=False keeps comparisons by identity."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cu_seqlens of the queries
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens in the KV cache after this pass
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, 0-padded
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot written for each query token
    query_lens: list[int]  # host copy of the query lengths (no device sync to read them)
    query_starts: list[int]  # host copy of query_start_loc
    seq_lens_host: list[int]  # host copy of seq_lens
    max_query_len: int
    max_seq_len: int
    # Per-backend values derived from the fields above (index tensors, masks), computed by the
    # first layer that reads this object and reused by the others.
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    device: torch.device,
) -> AttentionMetadata:
    """Lists in, one tensor copy per field to the device."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max((len(t) for t in block_tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_lens=list(query_lens),
        query_starts=starts,
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )

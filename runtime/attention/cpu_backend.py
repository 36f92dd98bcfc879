"""The torch backend's attention moved to a C++ kernel that reads the paged cache in place.

The torch backend gathers each sequence's K and V out of the paged cache into a padded copy and
runs SDPA on it; for one to a few queries per sequence that copy costs about as much as the
attention itself. runtime/csrc/paged_attention.cpp reads K and V straight from the cache blocks
instead, for every row of a step: decode, draft verification, draft steps and prompt chunks.

The kernel computes each query from its own visible keys in a fixed order: its result does not
depend on the other queries or sequences of the step. With panel_linear (runtime.cpu_gemm) that
makes every step batch- and chunk-invariant: a request's logits are the same bits whether it
decodes alone, verifies k drafts or runs next to 63 others, and whether its prompt was prefilled
in one chunk or in several (cut by the token budget, a prefix-cache hit or a recompute after
preemption). That is what keeps greedy tokens equal with and without a drafter, whose
verification rows change how the token budget cuts prompts. Torch's SDPA rounds by the chunk's
shape (a near-tie could flip a token), which is why prompt chunks no longer go to it, although
it is faster on long ones: prefill of the default model takes 0.88x / 0.99x / 1.14x / 1.17x
SDPA's time at 48 / 256 / 1,024 / 2,000 prompt tokens (2 threads, AMD EPYC, interleaved).

In bfloat16 and float16 the kernel widens each value it reads to float32 and rounds its result
once: the float32 result on the same (widened) inputs.

The kernel is built with the other CPU kernels (runtime.cpu_kernels); where it cannot be built,
"auto" falls back to the torch backend; EAGLEBATCH_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.attention.metadata import AttentionMetadata
from runtime.attention.torch_backend import TorchAttentionBackend

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # 16-bit: computed in float32


class KernelRows(NamedTuple):
    """A step's sequences as the kernel takes them (it computes every one)."""
    query_starts: torch.Tensor  # [num_seqs] int64
    query_lens: torch.Tensor  # [num_seqs] int64
    seq_lens: torch.Tensor  # [num_seqs] int64


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        if (query.dtype not in KERNEL_DTYPES or kv_cache.dtype != query.dtype
                or not kv_cache.is_contiguous()):  # the kernel's one layout; else the torch path
            return super().forward(query, key, value, kv_cache, md)
        torch.ops.eaglebatch.write_kv(kv_cache, key.contiguous(), value.contiguous(),
                                      md.slot_mapping)
        query = query.contiguous()
        out = torch.empty_like(query)
        if md.num_seqs == 0:  # an empty step: nothing to attend (its block table is 1-D)
            return out
        rows = kernel_rows(md, query.device)
        torch.ops.eaglebatch.paged_attention(
            query, kv_cache, out, rows.query_starts, rows.query_lens, rows.seq_lens,
            md.block_table, self.scale, self.sliding_window or 0)
        return out


def kernel_rows(md: AttentionMetadata, device: torch.device) -> KernelRows:
    """The step's rows for the kernel, made once per metadata object (all layers share it)."""
    if "cpu" not in md.derived:
        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)
        md.derived["cpu"] = KernelRows(as_tensor(md.query_starts[:-1]),
                                       as_tensor(md.query_lens), as_tensor(md.seq_lens_host))
    return md.derived["cpu"]

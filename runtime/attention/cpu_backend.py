"""The torch backend with short queries (decode, draft verification) moved to a C++ kernel.

The torch backend gathers each sequence's K and V out of the paged cache into a padded copy and
runs SDPA on it; for one to a few queries per sequence that copy costs about as much as the
attention itself. runtime/csrc/paged_attention.cpp reads K and V straight from the cache blocks
instead.
Rows of more than SHORT_QUERY queries (prefill chunks) still go through the torch path, whose SDPA
kernel is the faster one there (3-4x on prompts of 128 to 2048 tokens).

The kernel computes each query from its own visible keys in a fixed order: its result does not
depend on the other queries or sequences of the step. With panel_linear (runtime.cpu_gemm) that
makes decode and draft verification batch-invariant: after the same prefill, a request's logits
are the same bits whether it decodes alone, verifies k drafts, or runs next to 63 others. (SDPA
rounds by batch shape, so a prompt cut into other chunks can differ in the last bits.)

In bfloat16 and float16 the kernel widens each value it reads to float32 and rounds its result
once: the float32 result on the same (widened) inputs.

The kernel is built with the other CPU kernels (runtime.cpu_kernels); where it cannot be built,
"auto" falls back to the torch backend; EAGLEBATCH_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.attention.metadata import AttentionMetadata
from runtime.attention.torch_backend import TorchAttentionBackend, _Batched

SHORT_QUERY = 16
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # 16-bit: computed in float32


class _KernelRows(NamedTuple):
    rows: torch.Tensor  # [R] int64 sequences the kernel computes
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
        short, batches = self._cpu_plan(md, kv_cache.shape[2], query.device)
        if short is not None:
            torch.ops.eaglebatch.paged_attention(
                query, kv_cache, out, short.rows, short.query_starts, short.query_lens,
                short.seq_lens, md.block_table, self.scale, self.sliding_window or 0)
        self._attend_batches(query, kv_cache, batches, out)
        return out

    def _cpu_plan(self, md: AttentionMetadata, block_size: int, device: torch.device
                  ) -> tuple[_KernelRows | None, list[_Batched]]:
        key = f"cpu/{block_size}/{self.sliding_window}"
        if key not in md.derived:
            short = [i for i, n in enumerate(md.query_lens) if n <= SHORT_QUERY]
            long = [i for i, n in enumerate(md.query_lens) if n > SHORT_QUERY]
            kernel_rows = None
            if short:
                def as_tensor(values: list[int]) -> torch.Tensor:
                    return torch.tensor(values, dtype=torch.int64, device=device)
                kernel_rows = _KernelRows(as_tensor(short), as_tensor(md.query_starts[:-1]),
                                          as_tensor(md.query_lens), as_tensor(md.seq_lens_host))
            md.derived[key] = (kernel_rows, self._plan_rows(md, long, block_size, device))
        return md.derived[key]

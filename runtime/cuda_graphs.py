"""Decode steps replayed from CUDA graphs (opt-in: EngineConfig.cuda_graphs, `--cuda-graphs`).

On a GPU a small model's decode step is bound by the host: on an H200 a batch-16 step of
SmolLM2-135M took ~24 ms, of which the GPU was busy 3.5 ms, for ~1,270 kernel launches. A CUDA
graph records a step's kernels once and replays them with one launch. Graphs need fixed shapes and
fixed memory, so a pure decode step (one new token per sequence, no drafts) is padded to a bucket:
rows to the next power of two, KV blocks gathered per row to the next power of two. The step's
inputs are copied into the bucket's static buffers and the graph captured for the bucket (on its
first use) is replayed. Padded rows feed token 0 at position 0, write their K/V into the reserved
null block 0 and see its first key only; their outputs are dropped. Every other step (prefill
chunks, draft verification) and the drafter run eagerly.

Needs the torch attention backend and full attention (no sliding windows). With capture=False
the same buffers and plan run eagerly instead of replaying a graph (tests on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from runtime.attention import AttentionMetadata
from runtime.attention.torch_backend import set_decode_plan
from runtime.inputs import StepInputs
from runtime.model import CausalLM

Outputs = tuple[torch.Tensor, list[torch.Tensor]]  # hidden [rows, H], aux hidden states


def bucket(n: int) -> int:
    """The next power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class _Bucket(NamedTuple):
    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    metadata: AttentionMetadata  # its tensors are the static buffers the step is copied into
    run: Callable[[], Outputs]  # replays the graph (or runs the forward pass eagerly)


class DecodeGraphs:
    """Mutable: the buckets captured so far (keyed by padded rows and blocks) and their buffers.
    kv_caches: layer name -> [2, num_blocks, block_size, num_kv_heads, head_dim], written by the
    replayed steps like by eager ones."""

    def __init__(self, model: CausalLM, kv_caches: dict[str, torch.Tensor], block_size: int,
                 max_rows: int, max_blocks: int, aux_layer_ids: tuple[int, ...] = (),
                 capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_rows = bucket(max_rows)
        self.max_blocks = bucket(max_blocks)
        self.aux_layer_ids = aux_layer_ids
        self.capture = capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool: Any = None  # the graphs share one memory pool (a handle)

    def applies(self, step: StepInputs) -> bool:
        md = step.metadata
        return (md.max_query_len == 1 and md.num_seqs == md.num_tokens
                and md.num_seqs <= self.max_rows and self._blocks(md) <= self.max_blocks)

    def run(self, step: StepInputs) -> Outputs:
        """hidden and aux hidden states of the step's rows (copies: the next replay overwrites
        the static outputs)."""
        md = step.metadata
        rows, blocks = bucket(md.num_seqs), bucket(self._blocks(md))
        b = self.buckets.get((rows, blocks)) or self._build(rows, blocks)
        n, width = md.num_seqs, min(md.block_table.shape[1], blocks)
        static = b.metadata
        b.input_ids[:n].copy_(step.input_ids)
        b.input_ids[n:].zero_()
        b.positions[:n].copy_(step.positions)
        b.positions[n:].zero_()
        static.slot_mapping[:n].copy_(md.slot_mapping)
        static.slot_mapping[n:].zero_()  # slot 0: the null block
        static.seq_lens[:n].copy_(md.seq_lens)
        static.seq_lens[n:].fill_(1)  # padded rows see key 0 only
        static.block_table.zero_()
        static.block_table[:n, :width].copy_(md.block_table[:, :width])
        hidden, aux = b.run()
        return hidden[:n].clone(), [a[:n].clone() for a in aux]

    def _blocks(self, md: AttentionMetadata) -> int:
        return max(1, -(-md.max_seq_len // self.block_size))

    def _build(self, rows: int, blocks: int) -> _Bucket:
        device = self.model.model.embed_tokens.weight.device  # (a CPU head may hold none)
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        positions = torch.zeros(rows, dtype=torch.int64, device=device)
        md = AttentionMetadata(
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(rows, dtype=torch.int32, device=device),
            block_table=torch.zeros(rows, blocks, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
            query_lens=[1] * rows, query_starts=list(range(rows + 1)),
            seq_lens_host=[blocks * self.block_size] * rows, max_query_len=1,
            max_seq_len=blocks * self.block_size)
        metadata = {name: md for name in self.model.layer_names}

        def forward() -> Outputs:
            # Everything derived from the inputs is computed inside the pass, so a graph records
            # it (and an eager run over refilled buffers does not reuse stale values).
            md.derived.clear()
            self.model.rope.forget()
            set_decode_plan(md, self.block_size, blocks)
            out = self.model(ids, positions, self.kv_caches, metadata, self.aux_layer_ids)
            return out.hidden_states, list(out.aux_hidden_states)

        run = forward if not self.capture else self._capture(forward)
        built = _Bucket(ids, positions, md, run)
        self.buckets[(rows, blocks)] = built
        return built

    def _capture(self, forward: Callable[[], Outputs]) -> Callable[[], Outputs]:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisation, workspaces
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = forward()
        self._pool = graph.pool()

        def replay() -> Outputs:
            graph.replay()
            return outputs

        return replay

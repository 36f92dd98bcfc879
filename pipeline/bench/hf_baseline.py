"""The baseline most users start from: transformers `generate` on static, left-padded batches.

Prompts run in order, batch_size at a time; a batch ends when its longest request ends, so every
request of a batch finishes (latency) when the batch does. Output tokens are counted up to and
including the first EOS, as the engine counts them; the padding generated after it is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from pipeline.bench.engine_run import gpu_part_begins, gpu_part_ends
from pipeline.bench.metrics import TRANSFORMERS, RunRecord
from pipeline.bench.workload import Workload


class _FirstToken(BaseStreamer):
    """generate() calls put() with the prompt first, then with each step's new tokens."""

    def __init__(self, record: RunRecord, request_ids: Sequence[str]) -> None:
        self.record = record
        self.request_ids = request_ids
        self.calls = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        self.record.rss.sample()
        if self.calls == 2:
            now = self.record.clock()
            for request_id in self.request_ids:
                self.record.first_token(request_id, now)

    def end(self) -> None:
        pass


class TransformersBaseline:
    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: frozenset[int], pad_token_id: int | None) -> None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        # plain greedy, as the engine decodes: not the checkpoint's generation_config.json
        # (Qwen2.5-Instruct's repetition_penalty 1.05, a min_new_tokens, ... change the tokens)
        self.model.generation_config = GenerationConfig()
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id if pad_token_id is not None else min(eos_token_ids,
                                                                               default=0)

    def warm_up(self, workload: Workload, batch_size: int) -> None:
        """One untimed run of the first static batch of this size: transformers' first run at a
        batch size is markedly slower than its next ones (batch 64, 2 CPU threads: 157 then 186
        and 184 tokens/s), which would flatter the engine in a single-repeat bench."""
        self._generate(workload.prompts[:batch_size], max(workload.max_tokens[:batch_size]),
                       workload.ignore_eos, streamer=None)

    def run(self, workload: Workload, batch_size: int, record: RunRecord | None = None
            ) -> RunRecord:
        """Runs the workload's prompts; with `record` (paused), as the next part of that run."""
        gpu_part_begins(self.device)
        record = RunRecord(TRANSFORMERS, 0, batch_size) if record is None else record.resume()
        ids_of = workload.request_ids()
        for first in range(0, len(workload.prompts), batch_size):
            ids = ids_of[first:first + batch_size]
            prompts = workload.prompts[first:first + batch_size]
            # one max_new_tokens per static batch: the largest; rows are cut to their own below
            limits = workload.max_tokens[first:first + batch_size]
            new = self._generate(prompts, max(limits), workload.ignore_eos,
                                 _FirstToken(record, ids))
            now = record.clock()
            for request_id, row, limit in zip(ids, new, limits, strict=True):
                record.finish(request_id, self._cut(row[:limit], workload.ignore_eos), now)
        gpu_part_ends(self.device, record)
        return record

    def _generate(self, prompts: Sequence[tuple[int, ...]], max_new_tokens: int,
                  ignore_eos: bool, streamer: BaseStreamer | None) -> list[list[int]]:
        """The generated ids of each row (padding after EOS included). [batch, new tokens]"""
        width = max(len(p) for p in prompts)
        pad = self.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts],
                                 device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        eos = None if ignore_eos else sorted(self.eos_token_ids)  # None: never stop early
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=mask,
                                      max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=eos, pad_token_id=pad, streamer=streamer)
        return out[:, width:].tolist()

    def _cut(self, row: list[int], ignore_eos: bool) -> list[int]:
        if ignore_eos:
            return row
        for i, token in enumerate(row):
            if token in self.eos_token_ids:
                return row[:i + 1]
        return row

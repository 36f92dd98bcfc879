"""Timed runs of our engine: one Engine per (batch size, k), built once and reused for repeats.

The step hook reads the scheduler's running requests (read only) to time each request's first
token and, for the bandwidth floor, the context the next decode step will read.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.bench.metrics import ENGINE, RunRecord
from pipeline.bench.workload import Workload
from pipeline.config import JobError
from pipeline.job_engine import build_engine
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.model import head_dim_of
from runtime.request import Completion, GenerationRequest
from runtime.setup import place
from runtime.speculative.loader import drafter_num_layers, read_drafter_config

_KV_SLACK = 1.25


def engine_config(model_dir: Path, drafter: Path | None, k: int, batch_size: int,
                  workload: Workload, base: EngineConfig) -> EngineConfig:
    """base carries dtype, device, kv_cache_memory (None: sized here), the token budget, the
    draft confidence and largest drafting batch, the int8 and n-gram switches of drafting, the
    attention backend and prefix caching (EngineVariant.run empties the cache before each run,
    so that repeats of the same prompts do not hit it)."""
    config = EngineConfig(
        model=str(model_dir), drafter=str(drafter) if k and drafter else None,
        num_speculative_tokens=max(k, 1), max_num_seqs=batch_size, dtype=base.dtype,
        device=base.device, kv_cache_memory=base.kv_cache_memory,
        max_num_batched_tokens=base.max_num_batched_tokens,
        enable_prefix_caching=base.enable_prefix_caching,
        draft_confidence=base.draft_confidence, draft_int8=base.draft_int8,
        draft_max_batch=base.draft_max_batch, q4_panels=base.q4_panels,
        draft_ngram=base.draft_ngram, draft_ngram_tokens=base.draft_ngram_tokens,
        attention_backend=base.attention_backend, cuda_graphs=base.cuda_graphs)
    if config.kv_cache_memory is None:
        config = replace(config, kv_cache_memory=_kv_bytes_for_batch(config, workload))
    return config


def _kv_bytes_for_batch(config: EngineConfig, workload: Workload) -> int:
    """Enough KV cache for batch_size of the longest requests (plus draft lookahead), so the
    batch size, not the cache, limits concurrency. Several engines live at once in a bench,
    which is why the engine's own default (1 GiB, or most of the GPU) is not used."""
    from transformers import AutoConfig, LlamaConfig  # noqa: PLC0415

    p = place(config)
    target = AutoConfig.from_pretrained(config.model)
    # K and V values of one position, over all layers (a drafter's heads may not be the target's)
    values = 2 * target.num_key_value_heads * head_dim_of(target) * target.num_hidden_layers
    if config.drafter is not None:
        drafter = LlamaConfig(**read_drafter_config(Path(config.drafter)))
        values += (2 * (drafter.num_key_value_heads or drafter.num_attention_heads)
                   * head_dim_of(drafter) * drafter_num_layers(Path(config.drafter)))
    longest = max(len(ids) + n for ids, n in zip(workload.prompts, workload.max_tokens,
                                                            strict=True))
    blocks_per_seq = -(-(longest + 2 * config.draft_width + 2) // p.block_size) + 1
    block_bytes = p.block_size * values * p.dtype.itemsize
    blocks = int(config.max_num_seqs * blocks_per_seq * _KV_SLACK) + 2  # block 0 is reserved
    return blocks * block_bytes


class EngineVariant:
    def __init__(self, config: EngineConfig, k: int, bandwidth: float | None,
                 variant: str = ENGINE, target: Engine | None = None) -> None:
        """target: an engine of the same bench whose model this one runs on (same weights)."""
        self.config = config
        self.k = k
        self.variant = variant  # ENGINE, or CEILING once draft_from_reference is called
        model = None if target is None else target.model
        # a drafter or model that cannot load is a user error naming them, as in `generate`
        self.engine = build_engine(lambda c: Engine(c, model), config)
        self.bandwidth = bandwidth  # device copy bytes/s, measured on CUDA only
        # for the bandwidth floor, on CUDA (a CPU engine's Linears hold only packed copies)
        self.weight_bytes = (_weight_bytes_read_per_step(self.engine.model)
                             if bandwidth is not None else 0)
        hf = self.engine.hf_config
        self.kv_bytes_per_token = (2 * hf.num_hidden_layers * hf.num_key_value_heads *
                                   head_dim_of(hf) * self.engine.placement.dtype.itemsize)
        # of the last run: prompt tokens served from the prefix cache, and those looked up
        self.prefix_hits = (0, 0)

    @property
    def tokenizer(self) -> object:
        return self.engine.tokenizer

    def warm_up(self, workload: Workload) -> None:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        self._check(list(self.engine.generate([GenerationRequest("warm-up", workload.prompts[0],
                                                                 params)])))

    def run(self, workload: Workload, record: RunRecord | None = None) -> RunRecord:
        """Runs the workload's requests; with `record` (paused), as the next part of that run."""
        device = self.engine.placement.device
        gpu_part_begins(device)
        requests = workload.requests()
        pulled = [0]
        if record is None:  # a new run: it may reuse its own prompts' blocks, no earlier run's
            self.engine.reset_prefix_cache()
            self.prefix_hits = (0, 0)
        kv = self.engine.kv
        hits, queried = kv.hits_tokens, kv.queried_tokens
        record = (RunRecord(self.variant, self.k, self.config.max_num_seqs) if record is None
                  else record.resume())
        steps = _StepLog(record)

        def feed() -> Iterator[GenerationRequest]:
            for request in requests:
                pulled[0] += 1
                yield request

        def on_step(generated: int) -> None:
            now = record.clock()
            record.rss.sample()
            scheduler = self.engine.scheduler
            for seq in scheduler.running:
                if seq.num_output_tokens:
                    record.first_token(seq.request_id, now)
            decoding = (pulled[0] == len(requests) and not scheduler.waiting and all(
                s.num_computed_tokens >= s.num_prompt_tokens for s in scheduler.running))
            steps.step(now, decoding, sum(len(s.token_ids) for s in scheduler.running))

        for completion in self.engine.generate(feed(), on_step=on_step):
            self._check([completion])
            record.finish(completion.request_id, completion.token_ids, record.clock())
            record.spec.drafted += completion.num_drafted
            record.spec.accepted += completion.num_accepted
            record.spec.draft_steps += completion.num_draft_steps
            record.spec.add_positions(completion.accepted_per_position)
        gpu_part_ends(device, record)
        self.prefix_hits = (self.prefix_hits[0] + kv.hits_tokens - hits,
                            self.prefix_hits[1] + kv.queried_tokens - queried)
        if record.decode_steps:
            record.decode_step_s = statistics.median(record.decode_steps)
            if self.bandwidth is not None:
                floor_bytes = self.weight_bytes + self.kv_bytes_per_token * statistics.median(
                    record.decode_contexts)
                record.bandwidth_floor_s = floor_bytes / self.bandwidth
        return record

    @staticmethod
    def _check(completions: Sequence[Completion]) -> None:
        for c in completions:
            if c.finish_reason == "error":
                raise JobError(f"the engine refused a benchmark request: {c.error}")


def gpu_part_begins(device: torch.device) -> None:
    """Before a run or a part of one: on CUDA, the GPU idle and its peak memory reset (the
    other variants' turns in between must not count)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def gpu_part_ends(device: torch.device, record: RunRecord) -> None:
    """After a run or a part of one: the GPU idle, the run's clock paused, and on CUDA its peak
    memory the highest of its parts'."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    record.pause()
    if device.type == "cuda":
        record.peak_gpu_bytes = max(record.peak_gpu_bytes or 0,
                                    torch.cuda.max_memory_allocated(device))


def _weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Every parameter once (parameters() skips a tied lm_head), less an untied input
    embedding, of which a step reads only the rows of its tokens."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_parameter("model.embed_tokens.weight")
    if getattr(model.get_submodule("lm_head"), "weight", None) is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


class _StepLog:
    """Adds to `record` the durations of decode-only steps (every request admitted and past its
    prompt at the start of the step) and the context tokens each of them read."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.last: float | None = None
        self.next_is_decode = False
        self.next_context = 0

    def step(self, now: float, decoding: bool, context: int) -> None:
        if self.last is not None and self.next_is_decode:
            self.record.decode_steps.append(now - self.last)
            self.record.decode_contexts.append(self.next_context)
        self.last, self.next_is_decode, self.next_context = now, decoding, context


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes per second moved by a device-to-device copy (each byte is read once and written
    once, so 2 * nbytes move per copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    return 2 * nbytes * iters / seconds

"""Where an engine step's time goes on CUDA: step times of the default model at batch 16
(plain and k = 2), then torch.profiler's busiest host-side ops and cProfile's busiest Python
functions over a plain run. Prints tables; run by benchmarks/gpu/run.sh."""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

import pyarrow.parquet as pq
import torch
from torch.profiler import ProfilerActivity, profile

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.loader import default_drafter
from runtime.request import GenerationRequest

BATCH, TOKENS = int(os.environ.get("EB_BATCH", 16)), int(os.environ.get("EB_TOKENS", 48))


def prompts(engine: Engine, n: int) -> list[tuple[int, ...]]:
    texts = pq.read_table("examples/prompts.parquet").column("prompt").to_pylist()[:n]
    out = []
    for t in texts:
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                   add_generation_prompt=True, tokenize=True)
        out.append(tuple(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run(engine: Engine, ids: list[tuple[int, ...]], tokens: int) -> list[float]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    stamps = [time.perf_counter()]
    requests = [GenerationRequest(str(i), x, params) for i, x in enumerate(ids)]
    for _ in engine.generate(requests, on_step=lambda n: stamps.append(time.perf_counter())):
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]


def main() -> None:
    plain = Engine(EngineConfig(max_num_seqs=BATCH, kv_cache_memory=1 << 30))
    spec = Engine(EngineConfig(max_num_seqs=BATCH, kv_cache_memory=1 << 30,
                               drafter=str(default_drafter("smollm2-135m-instruct")),
                               num_speculative_tokens=2), plain.model)
    ids = prompts(plain, BATCH)
    for name, engine in (("plain", plain), ("k=2", spec)):
        run(engine, ids[:2], 4)
        steps = run(engine, ids, TOKENS)
        print(f"{name}: {len(steps)} steps, median {statistics.median(steps) * 1e3:.2f} ms, "
              f"last 20 median {statistics.median(steps[-20:]) * 1e3:.2f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = run(plain, ids, 16)
    print(f"profiled plain run: {len(steps)} steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    profiler = cProfile.Profile()
    profiler.enable()
    steps = run(plain, ids, 16)
    profiler.disable()
    print(f"cProfile plain run: {len(steps)} steps")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()

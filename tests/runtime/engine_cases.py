"""What the engine tests (test_engine_batching, test_engine_stops_and_errors) share: the tiny
llama's prompts, an engine of its checkpoint, the requests and their run, transformers' greedy
reference, and one torch thread per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest

BLOCK_SIZE = 4
# The tiny llama's KV block: 2 layers * (K and V) * 4 slots * 2 KV heads * 16 dims * 4 bytes
TINY_BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
LARGE_CACHE = 256 * TINY_BLOCK_BYTES
NUM_NEW = 16
PROMPT_LENGTHS = (1, 2, 3, 4, 5, 7, 9, 12, 16, 17, 23, 31, 40)
GREEDY = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)


def _prompt(length: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(4, 256, (length,), generator=generator).tolist())


PROMPTS = [_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]


def _engine(model_dir: Path, **options: object) -> Engine:
    settings: dict[str, object] = {
        "model": str(model_dir), "device": "cpu", "dtype": "float32",
        "attention_backend": "torch", "block_size": BLOCK_SIZE, "kv_cache_memory": LARGE_CACHE}
    settings.update(options)
    return Engine(EngineConfig(**settings))  # type: ignore[arg-type]


def _requests(prompts: list[tuple[int, ...]], params: SamplingParams = GREEDY,
              prefix: str = "r") -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]


def _run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, Completion]:
    completions = {c.request_id: c for c in engine.generate(requests)}
    assert sorted(completions) == sorted(r.request_id for r in requests)
    return completions


def _tokens(completions: dict[str, Completion]) -> dict[str, tuple[int, ...]]:
    return {rid: c.token_ids for rid, c in completions.items()}


class Reference:
    """transformers' greedy generate on one prompt at a time, memoized."""

    def __init__(self, model_dir: Path) -> None:
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
        self._memo: dict[tuple[tuple[int, ...], int, bool], tuple[int, ...]] = {}

    def greedy(self, prompt: tuple[int, ...], max_new_tokens: int = NUM_NEW,
               honour_eos: bool = False) -> tuple[int, ...]:
        key = (prompt, max_new_tokens, honour_eos)
        if key not in self._memo:
            # eos_token_id=None: generate exactly max_new_tokens (the engine's ignore_eos)
            eos = {} if honour_eos else {"eos_token_id": None}
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=max_new_tokens,
                                          attention_mask=torch.ones(1, len(prompt)), **eos)
            self._memo[key] = tuple(out[0, len(prompt):].tolist())
        return self._memo[key]

    def expected(self, requests: list[GenerationRequest]) -> dict[str, tuple[int, ...]]:
        return {r.request_id: self.greedy(r.prompt_token_ids, r.params.max_tokens)
                for r in requests}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: these models are small, and on a busy 2-core machine a second thread
    costs far more in synchronization than it gains (SmolLM2's 32 tokens: 5 s vs 33 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

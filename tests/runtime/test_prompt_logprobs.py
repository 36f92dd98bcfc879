"""SamplingParams.prompt_logprobs: each prompt token's log-probability given the tokens before it,
as transformers computes it, and the same bits however the prompt is cut, preempted, batched or
drafted after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest

NUM_NEW = 8
# The tiny llama's KV block at block size 4: 2 layers * (K and V) * 4 slots * 2 KV heads
# * 16 dims * 4 bytes
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4


def _prompt(length: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(4, 256, (length,), generator=generator).tolist())


SHARED = _prompt(21, seed=50)
PROMPTS = [_prompt(n, seed) for seed, n in enumerate((1, 2, 9, 30, 41))] + [
    SHARED + _prompt(6, seed=51), SHARED + _prompt(11, seed=52)]
WITH = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=True)
WITHOUT = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _engine(model_dir: Path, **options: Any) -> Engine:
    settings: dict[str, Any] = dict(model=str(model_dir), block_size=4,
                                    kv_cache_memory=1 << 20)
    settings.update(options)
    return Engine(EngineConfig(**settings))


def _run(engine: Engine, params: list[SamplingParams], prefix: str = "") -> dict[str, Completion]:
    requests = [GenerationRequest(f"{prefix}{i}", p, s)
                for i, (p, s) in enumerate(zip(PROMPTS, params, strict=True))]
    return {c.request_id: c for c in engine.generate(requests)}


def _outputs(completions: dict[str, Completion]) -> dict[str, Any]:
    return {rid: (c.token_ids, c.prompt_logprobs) for rid, c in completions.items()}


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Path) -> dict[str, Any]:
    """Each request alone in a fresh engine, its prompt in one chunk."""
    out = {}
    for i, prompt in enumerate(PROMPTS):
        engine = _engine(tiny_model_dir)
        out.update(_outputs({c.request_id: c for c in engine.generate(
            [GenerationRequest(str(i), prompt, WITH)])}))
    return out


def test_prompt_logprobs_are_transformers_log_softmax_at_the_next_prompt_token(
        tiny_hf_model: Any, alone: dict[str, Any], tiny_model_dir: Path) -> None:
    """One per prompt token after the first, within float32 rounding of transformers'; the
    tokens are those of a run without them (whose completions carry None)."""
    without = _run(_engine(tiny_model_dir), [WITHOUT] * len(PROMPTS))
    for rid, (tokens, logprobs) in alone.items():
        prompt = PROMPTS[int(rid)]
        assert tokens == without[rid].token_ids and without[rid].prompt_logprobs is None
        assert logprobs is not None and len(logprobs) == len(prompt) - 1
        if len(prompt) == 1:
            continue
        with torch.no_grad():
            logits = tiny_hf_model(torch.tensor([prompt])).logits[0].float()
        expected = torch.log_softmax(logits[:-1], dim=-1).gather(
            1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        assert (torch.tensor(logprobs) - expected).abs().max().item() < 1e-4
    assert alone["0"][1] == ()


@pytest.mark.parametrize("budget", [3, 7, 16, 2048])
def test_prompt_logprobs_are_the_same_bits_in_any_chunks_and_batch(
        tiny_model_dir: Path, alone: dict[str, Any], budget: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """All requests together, their prompts cut into chunks by a token budget of 3-2048, and
    the logits computed 5 rows at a time: each gets its tokens and prompt log-probabilities
    alone (==)."""
    monkeypatch.setattr("runtime.model_runner.PROMPT_LOGITS_ROWS", 5)
    engine = _engine(tiny_model_dir, max_num_batched_tokens=budget)
    assert _outputs(_run(engine, [WITH] * len(PROMPTS))) == alone


def test_prompt_logprobs_through_preemption_prefix_hits_and_drafts(
        tiny_model_dir: Path, tiny_random_drafter: Path, alone: dict[str, Any]) -> None:
    """Preempted and recomputed (the values are not recorded twice); after other requests
    cached the shared prefix (the prompt is computed whole anyway, and a request without
    prompt_logprobs still hits the cache); with a drafter: == alone."""
    # 14 usable blocks = 56 slots: the longest request (41 + 8 tokens) fits alone
    small = _engine(tiny_model_dir, kv_cache_memory=15 * BLOCK_BYTES, max_num_batched_tokens=8)
    assert _outputs(_run(small, [WITH] * len(PROMPTS))) == alone
    assert small.scheduler.num_preemptions > 0

    cached = _engine(tiny_model_dir)
    _run(cached, [WITHOUT] * len(PROMPTS), prefix="first-")
    hits = cached.kv.hits_tokens
    assert _outputs(_run(cached, [WITH] * len(PROMPTS))) == alone
    assert cached.kv.hits_tokens == hits  # no prompt was served from the cache
    plain = _run(cached, [WITHOUT] * len(PROMPTS), prefix="again-")
    assert cached.kv.hits_tokens > hits
    assert all(c.prompt_logprobs is None for c in plain.values())

    drafted = _engine(tiny_model_dir, drafter=str(tiny_random_drafter), num_speculative_tokens=3)
    params = [WITH, WITHOUT] * (len(PROMPTS) // 2) + [WITH]
    got = _outputs(_run(drafted, params))
    assert got == {rid: (tokens, logprobs if params[int(rid)].prompt_logprobs else None)
                   for rid, (tokens, logprobs) in alone.items()}

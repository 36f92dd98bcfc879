"""The requests that the log-probability tests (test_logprobs, test_top_logprobs) run: prompts
of the tiny model, samplings, and one engine run of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest

PROMPTS = [(5, 9, 5, 9, 5), (200, 3), (40, 41, 42, 40, 41, 42, 40), (7,), (100, 100, 100, 12)]
SAMPLINGS: list[dict[str, Any]] = [
    dict(), dict(temperature=0.8, top_k=50, seed=5),
    dict(repetition_penalty=1.3, presence_penalty=0.5),
    dict(temperature=1.2, top_p=0.9, seed=9, frequency_penalty=0.4)]


def run(model_dir: Path, params: list[SamplingParams], drafter: Path | None = None,
        reference: dict[str, tuple[int, ...]] | None = None, **options: object
        ) -> dict[str, Completion]:
    """PROMPTS with `params` (one each) in one fresh engine, by request id ("0" ...)."""
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                                 drafter=None if drafter is None else str(drafter),
                                 **options))  # type: ignore[arg-type]
    if reference is not None:
        engine.draft_from_reference(reference)
    requests = [GenerationRequest(str(i), p, s) for i, (p, s) in enumerate(
        zip(PROMPTS, params, strict=True))]
    return {c.request_id: c for c in engine.generate(requests)}

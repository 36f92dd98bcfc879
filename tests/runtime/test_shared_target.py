"""Engines over one target model (`Engine(config, target=...)`, what a bench does with its
variants): same outputs as engines with their own copy, one copy of the weights and of the exact
greedy head, and a clear error for a model that does not fit the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.drafter_fixtures import make_random_drafter
from tests.fixtures import random_prompt_requests

MAX_TOKENS = (12, 7, 9)


def _requests() -> list[GenerationRequest]:
    return random_prompt_requests([5 + 4 * i for i in range(len(MAX_TOKENS))],
                                  [SamplingParams(max_tokens=n, ignore_eos=True)
                                   for n in MAX_TOKENS], seed=3)


def _config(model_dir: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                        max_num_seqs=3, max_model_len=64, **kw)  # type: ignore[arg-type]


def _tokens(engine: Engine) -> dict[str, tuple[int, ...]]:
    return {c.request_id: c.token_ids for c in engine.generate(_requests())}


def test_engines_on_one_target_give_their_own_outputs(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter")
    alone = _tokens(Engine(_config(tiny_model_dir)))
    first = Engine(_config(tiny_model_dir, drafter=str(drafter), num_speculative_tokens=3))
    second = Engine(_config(tiny_model_dir), target=first.model)
    third = Engine(_config(tiny_model_dir, drafter=str(drafter), num_speculative_tokens=2),
                   target=first.model)
    assert second.model is first.model and third.model is first.model
    assert first.runner.exact_head is not None
    assert second.runner.exact_head is first.runner.exact_head
    for engine in (second, first, third, second):  # interleaved, as a bench runs them
        assert _tokens(engine) == alone


def test_a_target_that_does_not_fit_the_engine_is_refused(tiny_model_dir: Path) -> None:
    small = Engine(_config(tiny_model_dir, num_speculative_tokens=1))  # 64 + 2 * 1 + 2 positions
    with pytest.raises(ValueError, match="rotary tables for 68 positions, this engine needs 76"):
        Engine(_config(tiny_model_dir, num_speculative_tokens=5), target=small.model)
    with pytest.raises(ValueError, match="is torch.float32 on cpu, this engine runs "
                                         "torch.bfloat16 on cpu"):
        Engine(_config(tiny_model_dir, dtype="bfloat16"), target=small.model)
    with pytest.raises(ValueError, match="built with q4_panels=False, this engine has "
                                         "q4_panels=True"):
        Engine(_config(tiny_model_dir, num_speculative_tokens=1, q4_panels=True),
               target=small.model)

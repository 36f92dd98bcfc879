"""Engine.draft_from_reference: the drafter still runs, but requests with a reference output are
drafted its next tokens, so under greedy decoding every draft is accepted (the ceiling that
`eaglebatch bench --ceiling` measures). Outputs stay the target's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from tests.drafter_fixtures import make_random_drafter
from tests.fixtures import random_prompt_requests

K = 3
MAX_TOKENS = (17, 9, 12, 4)


def _requests() -> list[GenerationRequest]:
    return random_prompt_requests([6 + 2 * i for i in range(len(MAX_TOKENS))],
                                  [SamplingParams(max_tokens=n, ignore_eos=True)
                                   for n in MAX_TOKENS], seed=1)


def _engine(model_dir: Path, drafter: Path | None) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                               max_num_seqs=4, num_speculative_tokens=K,
                               drafter=None if drafter is None else str(drafter)))


def _generate(engine: Engine) -> dict[str, Completion]:
    return {c.request_id: c for c in engine.generate(_requests())}


@pytest.fixture(scope="module")
def drafter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter"))


def test_reference_drafts_are_all_accepted_and_outputs_stay_the_targets(
        tiny_model_dir: Path, drafter: Path) -> None:
    plain = _generate(_engine(tiny_model_dir, None))
    reference = {rid: tuple(c.token_ids) for rid, c in plain.items() if rid != "3"}
    engine = _engine(tiny_model_dir, drafter)
    engine.draft_from_reference(reference)
    got = _generate(engine)
    assert {rid: c.token_ids for rid, c in got.items()} == \
        {rid: c.token_ids for rid, c in plain.items()}
    for rid, n in zip(("0", "1", "2"), MAX_TOKENS, strict=False):
        c = got[rid]
        # the prefill step emits one token; every later step verifies K drafts, all accepted,
        # and emits K + 1 tokens (fewer only where max_tokens leaves less room)
        assert c.num_draft_steps == -(-(n - 1) // (K + 1))
        assert c.num_accepted == c.num_drafted == n - 1 - c.num_draft_steps
    # request 3 has no reference: it keeps the random drafter's drafts, mostly rejected
    assert got["3"].num_drafted > got["3"].num_accepted


def test_an_engine_without_drafter_refuses_reference_drafts(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs an engine with a drafter"):
        _engine(tiny_model_dir, None).draft_from_reference({"0": (1, 2)})

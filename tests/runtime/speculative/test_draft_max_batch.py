"""draft_max_batch: requests get no drafts in steps where more requests sample than the limit,
and get them again as the batch drains; outputs are the target's either way (greedy, and seeded
samples: their draws do not depend on drafting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.drafter_fixtures import make_random_drafter
from tests.fixtures import random_prompt_requests

MAX_TOKENS = (24, 6, 10, 30, 8, 16)  # unequal lengths: the batch drains from 6 to 1


def _requests(params: SamplingParams | None = None) -> list[GenerationRequest]:
    return random_prompt_requests([5 + 3 * i for i in range(len(MAX_TOKENS))],
                                  params or [SamplingParams(max_tokens=n, ignore_eos=True)
                                             for n in MAX_TOKENS], seed=0)


def _run(model_dir: Path, requests: list[GenerationRequest], **engine_kw: Any
         ) -> tuple[dict[str, list[int]], list[tuple[int, bool]]]:
    """Tokens per request, and per propose call: (requests sampling, any drafts returned)."""
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                                 max_num_seqs=6, **engine_kw))
    calls: list[tuple[int, bool]] = []
    if engine.proposer is not None:
        propose = engine.proposer.propose

        def recording(step: Any, out: Any, features: Any, emitted: list[Any],
                      verified: list[int]) -> list[list[int]]:
            drafts = propose(step, out, features, emitted, verified)
            calls.append((sum(e is not None for e in emitted), any(drafts)))
            return drafts
        engine.proposer.propose = recording  # type: ignore[method-assign]
    return {c.request_id: c.token_ids for c in engine.generate(requests)}, calls


@pytest.fixture(scope="module")
def drafter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter"))


def test_greedy_drafts_only_at_or_below_the_limit_and_outputs_stay_the_targets(
        tiny_model_dir: Path, drafter: Path) -> None:
    want, _ = _run(tiny_model_dir, _requests())
    got, calls = _run(tiny_model_dir, _requests(), drafter=str(drafter),
                      num_speculative_tokens=3, draft_max_batch=2)
    assert got == want
    assert [drafted for n, drafted in calls] == [0 < n <= 2 for n, _ in calls]
    assert any(n > 2 for n, _ in calls) and any(0 < n <= 2 for n, _ in calls)


def test_requests_that_sample_draft_below_the_limit_and_draw_the_same_tokens(
        tiny_model_dir: Path, drafter: Path) -> None:
    """A seeded draw does not depend on drafting (a draft is accepted where it equals it), so
    sampled requests keep to the limit too (they drafted at any batch: a sampled job of 1000
    rows with the shipped drafter took 2.4x the time without it)."""
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=7 + n, ignore_eos=True)
              for n in MAX_TOKENS]
    alone, _ = _run(tiny_model_dir, _requests(params))
    unlimited, _ = _run(tiny_model_dir, _requests(params), drafter=str(drafter),
                        num_speculative_tokens=3)
    limited, calls = _run(tiny_model_dir, _requests(params), drafter=str(drafter),
                          num_speculative_tokens=3, draft_max_batch=2)
    assert limited == unlimited == alone
    assert [drafted for n, drafted in calls] == [0 < n <= 2 for n, _ in calls]
    assert any(n > 2 for n, _ in calls) and any(0 < n <= 2 for n, _ in calls)


def test_draft_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="draft_max_batch"):
        EngineConfig(draft_max_batch=0)


def test_steps_without_drafts_stash_decode_rows_and_the_drafter_reads_every_position_later(
        tiny_model_dir: Path, drafter: Path) -> None:
    """Over the limit the drafter runs only over prompt rows; the decode positions of those steps
    are fed to it, in order and without a gap, in the next step that drafts (so its KV is
    complete)."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                 kv_cache_memory=1 << 20, max_num_seqs=6,
                                 drafter=str(drafter), num_speculative_tokens=3,
                                 draft_max_batch=2))
    proposer = engine.proposer
    assert proposer is not None
    fed: dict[str, list[tuple[int, int]]] = {}
    skipped: list[bool] = []
    scheduled: list[Any] = []
    propose, step_one = proposer.propose, proposer._step_one

    def recording_step_one(rows: Any, feats: Any, tables: Any) -> Any:
        seqs = scheduled[-1]
        if len(rows.starts) < len(seqs):  # a step without drafts: its prompt rows only
            seqs = [s for s, start, _ in seqs if start < s.num_prompt_tokens]
            assert skipped[-1]
        else:  # a drafting step, or one without drafts where every row is a prompt row
            assert not skipped[-1] or all(start < s.num_prompt_tokens for s, start, _ in seqs)
            seqs = [s for s, _, _ in seqs]
        for seq, start, n in zip(seqs, rows.starts, rows.query_lens, strict=True):
            fed.setdefault(seq.request_id, []).append((start, start + n))
        return step_one(rows, feats, tables)

    def recording_propose(step: Any, out: Any, features: Any, emitted: list[Any],
                          verified: list[int]) -> list[list[int]]:
        scheduled.append(out.scheduled)
        skipped.append(sum(e is not None for e in emitted) > 2)
        drafts = propose(step, out, features, emitted, verified)
        assert not (skipped[-1] and any(drafts))
        return drafts

    proposer._step_one = recording_step_one  # type: ignore[method-assign]
    proposer.propose = recording_propose  # type: ignore[method-assign]
    done = {c.request_id: c for c in engine.generate(_requests())}
    assert any(skipped)
    for ranges in fed.values():
        assert ranges[0][0] == 0
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), ranges
    drafted = [r for r, c in done.items() if c.num_drafted]
    assert drafted  # the batch drained below the limit
    for r in drafted:  # a request that drafted had the drafter read its prompt and more
        assert fed[r][-1][1] > len(done[r].prompt_token_ids)

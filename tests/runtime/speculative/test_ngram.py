"""N-gram lookup drafts: exact proposals from the index, and in the engine the same greedy tokens
with more of the drafts accepted where the text repeats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from runtime.speculative.ngram import NgramIndex
from tests.drafter_fixtures import make_random_drafter


def proposal(tokens: list[int], k: int) -> list[int]:
    index = NgramIndex()
    index.extend(tokens)
    return index.propose(tokens, k)


def test_the_docstring_example_and_the_longest_latest_match() -> None:
    assert proposal([5, 6, 7, 8, 5, 6], 2) == [7, 8]
    # [1, 2, 3] occurred at 0..2 (then 9) and [2, 3] later at 5..6 (then 4): the longer one wins
    assert proposal([1, 2, 3, 9, 0, 2, 3, 4, 1, 2, 3], 3) == [9, 0, 2]
    # [7, 7] occurred at 0..1 (then 5) and at 3..4 (then 8): the latest one
    assert proposal([7, 7, 5, 7, 7, 8, 7, 7], 3) == [8, 7, 7]
    # proposals stop at the end of what is known
    assert proposal([4, 5, 4, 5], 3) == [4, 5]
    assert proposal([1, 2, 3, 4], 3) == [] and proposal([1], 3) == [] and proposal([], 3) == []


def test_a_proposal_continued_past_drafts_not_indexed() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 9, 1, 2]
    index.extend(tokens)
    # with the draft 3 appended, [1, 2, 3] occurred at 0..2: what followed it, then the rest
    assert index.propose_after(tokens, [3], 3) == [4, 9, 1]
    assert index.propose_after(tokens, [3], 8) == [4, 9, 1, 2, 3]  # up to the draft itself
    assert index.propose_after(tokens, [7], 3) == []  # [2, 7] never occurred
    assert index.propose_after(tokens, [], 2) == index.propose(tokens, 2) == [3, 4]


def test_indexing_in_pieces_equals_indexing_at_once() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()
    grown = NgramIndex()
    for end in range(0, 301, 7):
        grown.extend(tokens[:end])
        for k in (1, 3):
            assert grown.propose(tokens[:end], k) == proposal(tokens[:end], k), (end, k)
    # brute force: the longest suffix (4, 3, 2) with an earlier occurrence, its latest one
    for end in range(2, 300):
        seen, want = tokens[:end], []
        for n in (4, 3, 2):
            starts = [s for s in range(end - n) if seen[s:s + n] == seen[end - n:]]
            if end > n and starts:
                want = seen[starts[-1] + n:starts[-1] + n + 3]
                break
        assert proposal(seen, 3) == want, end


def _looping(model_dir: Path, tmp_path: Path) -> tuple[Path, list[list[int]]]:
    """A random 2-layer drafter, and prompts on which the tiny random model falls into loops."""
    drafter = make_random_drafter(model_dir, tmp_path / "drafter", num_layers=2, seed=3)
    g = torch.Generator().manual_seed(1)
    return drafter, [torch.randint(4, 250, (n,), generator=g).tolist() for n in (6, 15, 3, 11)]


@pytest.mark.parametrize("ngram_tokens", [0, 6])
def test_engine_with_ngram_drafts_gives_the_same_tokens_and_accepts_more(
        tiny_model_dir: Path, tmp_path: Path, ngram_tokens: int) -> None:
    """The tiny random model falls into loops: n-gram drafts find them, a random drafter does
    not. Greedy tokens stay those of the target alone, under preemption too (and with lookups
    of up to 6 for a request alone in its step: 6 KV slots ahead of every request)."""
    drafter, prompts = _looping(tiny_model_dir, tmp_path)
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    def run(**kw: object) -> tuple[Engine, dict[str, Completion]]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, **kw))  # type: ignore[arg-type]
        requests = [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)]
        return engine, {c.request_id: c for c in engine.generate(requests)}

    _, plain = run()
    want = {k: c.token_ids for k, c in plain.items()}
    _, drafted = run(drafter=str(drafter), num_speculative_tokens=3)
    engine, looked_up = run(drafter=str(drafter), num_speculative_tokens=3, draft_ngram=True,
                            draft_ngram_tokens=ngram_tokens, kv_cache_memory=200_000)
    assert engine.scheduler.num_preemptions > 0
    assert {k: c.token_ids for k, c in drafted.items()} == want
    assert {k: c.token_ids for k, c in looked_up.items()} == want
    assert all(c.finish_reason == "length" for c in looked_up.values())
    accepted = sum(c.num_accepted for c in looked_up.values())
    assert accepted > 10 * sum(c.num_accepted for c in drafted.values())
    assert accepted > sum(len(c.token_ids) for c in looked_up.values()) // 16
    for c in looked_up.values():
        assert c.num_accepted <= c.num_drafted <= max(3, ngram_tokens) * c.num_draft_steps
        assert sum(c.accepted_per_position) == c.num_accepted


@pytest.mark.parametrize("draft_ngram", [False, True])
def test_seeded_sampling_with_ngram_drafts_is_reproducible(tiny_model_dir: Path, tmp_path: Path,
                                                          draft_ngram: bool) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter", num_layers=1, seed=4)
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, drafter=str(drafter),
                          num_speculative_tokens=2, draft_ngram=draft_ngram)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)

    def run() -> tuple[int, ...]:
        request = GenerationRequest("a", (5, 9, 13, 5, 9), params)
        return next(iter(Engine(config).generate([request]))).token_ids

    first = run()
    assert len(first) == 30 and run() == first


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_steps_drafted_from_lookups_alone_defer_the_drafter_and_change_no_draft(
        tiny_model_dir: Path, tmp_path: Path, max_num_seqs: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every request drafts from its n-gram lookup, the drafter's step 1 waits in the
    stash for the next step that drafts: the same drafts (so the same counts), fewer forwards."""
    from runtime.speculative.proposer import EagleProposer

    drafter, prompts = _looping(tiny_model_dir, tmp_path)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    forwards = [0]
    run_drafter = EagleProposer._run

    def counted(self: EagleProposer, *args: object) -> torch.Tensor:
        forwards[0] += 1
        return run_drafter(self, *args)  # type: ignore[arg-type]
    monkeypatch.setattr(EagleProposer, "_run", counted)

    def run() -> tuple[dict[str, tuple[object, ...]], int]:
        forwards[0] = 0
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                     drafter=str(drafter), num_speculative_tokens=3,
                                     draft_ngram=True, max_num_seqs=max_num_seqs))
        requests = [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)]
        return {c.request_id: (c.token_ids, c.num_drafted, c.num_accepted,
                               tuple(c.accepted_per_position))
                for c in engine.generate(requests)}, forwards[0]

    deferred, fewer = run()
    monkeypatch.setattr(EagleProposer, "_drafter_idle", staticmethod(lambda skip, _: skip))
    every_step, more = run()
    assert deferred == every_step
    # the loops of the tiny model are drafted from lookups (a random drafter is rarely right)
    assert sum(c[2] for c in deferred.values()) > 30  # type: ignore[misc]
    assert fewer < more


def test_draft_width_is_k_or_the_longer_lookups() -> None:
    def width(**kw: object) -> int:
        return EngineConfig(num_speculative_tokens=2, **kw).draft_width  # type: ignore[arg-type]

    assert width() == 2 and width(draft_ngram=True) == 2
    assert width(draft_ngram=True, draft_ngram_tokens=6) == 6
    assert width(draft_ngram=False, draft_ngram_tokens=6) == 2  # no lookups, no longer drafts
    assert width(draft_ngram=True, draft_ngram_tokens=1) == 2
    with pytest.raises(ValueError, match="draft_ngram_tokens must be >= 0"):
        EngineConfig(draft_ngram_tokens=-1)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_a_greedy_request_alone_takes_longer_lookups_and_batched_ones_k(
        tiny_model_dir: Path, tmp_path: Path, max_num_seqs: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """draft_ngram_tokens = 6 with k = 2: a greedy request sampling alone in its step drafts up
    to 6 tokens from its lookup, requests sampling together up to 2; the tokens stay the
    target's own, and positions past k are accepted only from the long lookups."""
    from runtime.speculative.proposer import EagleProposer

    drafter, prompts = _looping(tiny_model_dir, tmp_path)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    seen: list[tuple[int, int]] = []  # per step: (requests sampling, longest lookup)
    lookups = EagleProposer._ngram_drafts
    continue_drafts = EagleProposer._continued
    continued = [0]  # drafter proposals offered to a lookup's continuation (a random drafter's
    # rarely continue: their unit test is test_a_proposal_continued_past_drafts_not_indexed)

    def counted(self: EagleProposer, out: object, i: int, proposal: list[int],
                emitted: object) -> list[int]:
        longer = continue_drafts(self, out, i, proposal, emitted)  # type: ignore[arg-type]
        assert longer[:len(proposal)] == proposal and len(longer) <= 6
        continued[0] += 1
        return longer
    monkeypatch.setattr(EagleProposer, "_continued", counted)

    def logged(self: EagleProposer, out: object, sampling: list[int],
               emitted: object) -> list[list[int]]:
        drafts = lookups(self, out, sampling, emitted)  # type: ignore[arg-type]
        seen.append((len(sampling), max(len(d) for d in drafts)))
        return drafts
    monkeypatch.setattr(EagleProposer, "_ngram_drafts", logged)

    def run(**kw: object) -> dict[str, Completion]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                     max_num_seqs=max_num_seqs, **kw))  # type: ignore[arg-type]
        requests = [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)]
        return {c.request_id: c for c in engine.generate(requests)}

    plain = run()
    long = run(drafter=str(drafter), num_speculative_tokens=2, draft_ngram=True,
               draft_ngram_tokens=6)
    assert {k: c.token_ids for k, c in long.items()} == {k: c.token_ids for k, c in plain.items()}
    alone = [n for count, n in seen if count == 1]
    together = [n for count, n in seen if count > 1]
    assert max(together, default=0) <= 2
    assert max(alone) == 6  # the tiny model's loops are long: lookups fill the whole width
    for c in long.values():  # k positions, more where a long lookup got further
        assert 2 <= len(c.accepted_per_position) <= 6
        assert c.num_drafted <= 6 * c.num_draft_steps
        assert sum(c.accepted_per_position) == c.num_accepted
    beyond_k = sum(sum(c.accepted_per_position[2:]) for c in long.values())
    if max_num_seqs == 1:
        assert not together and beyond_k > 0 and continued[0] > 0
    else:
        assert together  # four requests at once: most steps are shared
    seen.clear()
    sampled = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, drafter=str(drafter),
                                 num_speculative_tokens=2, draft_ngram=True,
                                 draft_ngram_tokens=6))
    list(engine.generate([GenerationRequest("s", tuple(prompts[0]), sampled)]))
    assert seen and max(n for _, n in seen) <= 2  # a request that samples keeps k

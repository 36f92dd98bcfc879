from __future__ import annotations

import pytest

from runtime.speculative.metrics import SpecDecodingStats


def observed(k: int, steps: list[tuple[int, int]]) -> SpecDecodingStats:
    stats = SpecDecodingStats(k)
    for num_draft, num_accepted in steps:
        stats.observe(num_draft, num_accepted)
    return stats


def test_counts_and_rates() -> None:
    # 4 draft steps of k = 3: accepted 3, 1, 0, 2 -> 6 of 12; one plain step counts nothing.
    stats = observed(3, [(3, 3), (3, 1), (0, 0), (3, 0), (3, 2)])
    assert (stats.num_draft_steps, stats.num_drafted, stats.num_accepted) == (4, 12, 6)
    assert stats.accepted_per_position == [3, 2, 1]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_acceptance_length == 2.5
    assert stats.per_position_rates == [0.75, 0.5, 0.25]


def test_short_draft_steps_count_their_own_drafts() -> None:
    stats = observed(4, [(2, 2), (4, 1)])
    assert stats.num_drafted == 6 and stats.num_accepted == 3
    assert stats.accepted_per_position == [2, 1, 0, 0]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_acceptance_length == 2.5


def test_no_drafts_gives_none() -> None:
    stats = observed(3, [(0, 0), (0, 0)])
    assert stats.num_draft_steps == 0
    assert stats.acceptance_rate is None
    assert stats.mean_acceptance_length is None
    assert stats.per_position_rates is None
    assert stats.summary_line() == "no draft tokens"


@pytest.mark.parametrize(("num_draft", "num_accepted"), [(2, 3), (4, 0), (-1, 0), (1, -1)])
def test_observe_rejects_impossible_counts(num_draft: int, num_accepted: int) -> None:
    with pytest.raises(ValueError):
        SpecDecodingStats(3).observe(num_draft, num_accepted)


def test_merge_adds_counts_and_grows_k() -> None:
    a = observed(3, [(3, 3), (3, 1)])
    b = observed(4, [(4, 4)])
    a.merge(b)
    assert (a.num_draft_steps, a.num_drafted, a.num_accepted) == (3, 10, 8)
    assert a.accepted_per_position == [3, 2, 2, 1]
    assert b.accepted_per_position == [1, 1, 1, 1]  # other is not modified


def test_summary_line() -> None:
    stats = observed(3, [(3, 3), (3, 1), (3, 0), (3, 2)])
    assert stats.summary_line() == (
        "acceptance rate 50.0% | mean acceptance length 2.50 | per position 0.75 0.50 0.25")


def test_to_dict() -> None:
    assert observed(2, [(2, 1)]).to_dict() == {
        "num_draft_steps": 1,
        "num_drafted": 2,
        "num_accepted": 1,
        "accepted_per_position": [1, 0],
        "acceptance_rate": 0.5,
        "mean_acceptance_length": 2.0,
        "per_position_rates": [1.0, 0.0],
    }


def test_slots() -> None:
    with pytest.raises(AttributeError):
        SpecDecodingStats(1).typo = 1  # type: ignore[attr-defined]

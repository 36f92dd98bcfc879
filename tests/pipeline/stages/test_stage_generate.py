"""Generate stage: request ids, derived seeds, and a round trip through the real tiny engine."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeline.stages.generate import build_requests, generate_rows, sample_seed
from pipeline.stages.tokenize import PreparedRow
from runtime.config import SamplingParams
from runtime.request import GenerationRequest

GREEDY = SamplingParams(max_tokens=4)
ROWS = [PreparedRow((1, 50, 60), GREEDY, False, None),
        PreparedRow(None, None, False, "prompt is null"),
        PreparedRow((1, 70), replace(GREEDY, seed=5), False, None, row_seed=True)]


def test_sample_seed_is_a_fixed_function_of_its_inputs() -> None:
    # Hard-coded: changing the derivation would change the samples of resumed jobs.
    assert sample_seed(7, "r1", 0) == 9128822105249980181
    assert sample_seed(None, "r1", 1) == 9113847409856558650
    assert len({sample_seed(7, "r1", s) for s in range(100)}) == 100
    assert sample_seed(7, "r1", 0) != sample_seed(7, "r2", 0) != sample_seed(8, "r1", 0)


def test_one_request_per_good_row_with_the_row_params() -> None:
    requests = list(build_requests(ROWS, ["a", "b", "c"], n=1))
    assert requests == [GenerationRequest("0:0", (1, 50, 60), GREEDY),
                        GenerationRequest("2:0", (1, 70), replace(GREEDY, seed=5))]


def test_n_samples_get_seeds_from_job_or_row_seed_row_id_and_index() -> None:
    requests = list(build_requests(ROWS, ["a", "b", "c"], n=2))
    assert [r.request_id for r in requests] == ["0:0", "0:1", "2:0", "2:1"]
    assert [r.params.seed for r in requests] == [
        sample_seed(None, "a", 0), sample_seed(None, "a", 1),
        sample_seed(5, "c", 0), sample_seed(5, "c", 1)]
    assert [r.params.max_tokens for r in requests] == [4, 4, 4, 4]


def test_under_a_job_seed_each_row_gets_its_own() -> None:
    """A job seed (not a row's seed column) is mixed with the row id even for one sample, so
    the same prompt twice gets independent samples; a row's own seed is used as given."""
    seeded = replace(GREEDY, temperature=1.0, seed=7)
    rows = [PreparedRow((1, 50), seeded, False, None), PreparedRow((1, 50), seeded, False, None),
            PreparedRow((1, 50), seeded, False, None, row_seed=True)]
    requests = list(build_requests(rows, ["a", "b", "c"], n=1))
    assert [r.params.seed for r in requests] == [sample_seed(7, "a", 0), sample_seed(7, "b", 0),
                                                 7]


def test_same_prompt_under_a_job_seed_samples_differently(tiny_engine: Any) -> None:
    seeded = replace(GREEDY, max_tokens=12, temperature=1.0, seed=7)
    rows = [PreparedRow((1, 50), seeded, False, None)] * 2
    first, second = sorted(generate_rows(tiny_engine, rows, ["a", "b"], n=1))
    again = sorted(generate_rows(tiny_engine, rows, ["a", "b"], n=1))
    assert first.completion.token_ids != second.completion.token_ids
    assert [r.completion.token_ids for r in again] == [first.completion.token_ids,
                                                       second.completion.token_ids]


def test_requests_are_pulled_lazily() -> None:
    pulled = build_requests(ROWS, ["a", "b", "c"], n=3)
    assert next(pulled).request_id == "0:0"  # nothing beyond the first request was built


def test_round_trip_through_the_engine_finds_each_row(tiny_engine: Any) -> None:
    results = sorted(generate_rows(tiny_engine, ROWS, ["a", "b", "c"], n=1))
    assert [(r.row, r.sample) for r in results] == [(0, 0), (2, 0)]
    assert [len(r.completion.token_ids) for r in results] == [4, 4]
    assert results[0].completion.prompt_token_ids == (1, 50, 60)

"""The job report's pure parts: a resumed job's shards plotted run by run, busy seconds that count
overlapping shards once, a long job's tokens/s in stretches, a run's runner described."""

from __future__ import annotations

from pathlib import Path


def test_a_resumed_jobs_shards_plot_in_separate_runs() -> None:
    from pipeline.bench.job_timeline import time_segments, time_unit  # noqa: PLC0415

    spans = [(0.0, 60.0, 10.0), (60.0, 120.0, 11.0), (900.0, 960.0, 12.0),
             (905.0, 970.0, 13.0)]  # two workers after the resume
    assert time_segments(spans, [-5.0, 850.0]) == [[(1.0, 10.0), (2.0, 11.0)],
                                                   [(16.0, 12.0), (970 / 60, 13.0)]]
    # the runs the manifest recorded split the line, not the gaps between shards
    assert time_segments(spans, [-5.0]) == [[(1.0, 10.0), (2.0, 11.0), (16.0, 12.0),
                                             (970 / 60, 13.0)]]
    assert time_segments(spans[:2], [-5.0, 100.0], scale=1.0) == [[(60.0, 10.0)],
                                                                  [(120.0, 11.0)]]
    assert time_unit(100.0) == ("seconds", 1.0) and time_unit(600.0) == ("minutes", 60.0)
    assert time_unit(5 * 3600.0) == ("hours", 3600.0)


def test_busy_seconds_count_overlapping_shards_once() -> None:
    from pipeline.stats import busy_seconds  # noqa: PLC0415

    assert busy_seconds([(0.0, 10.0), (5.0, 12.0), (20.0, 25.0)]) == 17.0
    assert busy_seconds([(0.0, 10.0), (2.0, 3.0)]) == 10.0
    assert busy_seconds([]) == 0.0


def test_a_job_of_many_shards_plots_its_tokens_per_s_in_stretches(tmp_path: Path) -> None:
    """1,654 one-row shards drew 1,654 points (those of error rows at 0): a solid block. Above
    200 shards the plot shows the tokens/s of the shards committed in each of 100 stretches."""
    from pipeline.bench.job_timeline import binned_rates, throughput_plot  # noqa: PLC0415
    from pipeline.stats import Counts  # noqa: PLC0415

    assert binned_rates([[(0.0, (10.0, 1.0)), (1.0, (30.0, 1.0)), (4.0, (5.0, 5.0))]], 2) == [
        [(1.0, 20.0), (3.0, 1.0)]]
    assert binned_rates([[(0.0, (0.0, 0.0))], [(8.0, (8.0, 2.0))]], 4) == [
        [(1.0, 0.0)], [(7.0, 4.0)]]  # two runs stay apart; an error-only stretch reads 0
    # 400 shards of 1 s each, one after the other; every other one only error rows (no tokens,
    # no time): each stretch of 2 s holds 2 shards of 10 tokens in 1 s each -> 10 tokens/s
    shards, spans = {}, {}
    for s in range(400):
        errors = s % 2 == 1
        shards[s] = Counts(rows=1, errors=int(errors), completion_tokens=0 if errors else 10,
                           wall_seconds=0.0 if errors else 1.0)
        spans[s] = (float(s // 2), float(s // 2) + (0.0 if errors else 1.0))
    drawn = throughput_plot(shards, spans, [{"started": -1.0}], tmp_path / "t.png")
    points = drawn["output tokens/s"]
    assert len(points) == 100 and {rate for _, rate in points} == {10.0}
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_a_runs_runner_is_described_with_its_workers() -> None:
    from pipeline.bench.job_report import _run  # noqa: PLC0415

    assert _run({"runner": "local"}) == "start unknown (local)"
    assert _run({"runner": "ray", "workers": 1}) == "start unknown (ray, 1 worker)"
    assert _run({"runner": "ray", "workers": 4}) == "start unknown (ray, 4 workers)"
    assert _run({"runner": "ray", "workers": None}) == (
        "start unknown (ray, workers as the cluster allows (--num-workers not given))")

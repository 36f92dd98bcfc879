"""`eaglebatch bench --ceiling`: every k > 0 also runs with perfect drafts (the k = 0 run's own
tokens), all accepted, same outputs; the report gives their ratio over k = 0 and plots it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench.aggregate import summarize
from pipeline.bench.bench_file import read_bench_parquet
from pipeline.bench.plots import plot_speedup
from tests.pipeline.bench.conftest import BENCH_PROMPTS, MAX_TOKENS, run_bench_cli

LABELS = ["engine k=0", "engine k=2", "perfect drafts k=2"]


@pytest.fixture(scope="module")
def ceiling_dir(tiny_model_dir: Path, tiny_drafter_dir: Path, prompts_file: Path,
                tmp_path_factory: pytest.TempPathFactory, one_thread_module: None) -> Path:
    out = tmp_path_factory.mktemp("bench-ceiling") / "report"
    result = run_bench_cli(
        "--model", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
        "--prompts", str(prompts_file), "--out", str(out), "--batch-sizes", "1,3", "--k", "0,2",
        "--max-tokens", str(MAX_TOKENS), "--repeats", "2", "--baseline", "none",
        "--ignore-eos", "--ceiling", "--draft-confidence", "0")
    assert result.exit_code == 0, result.output
    return out


def test_perfect_drafts_run_after_k0_in_every_round_and_are_all_accepted(
        ceiling_dir: Path) -> None:
    rows, meta = read_bench_parquet(ceiling_dir / "bench.parquet")
    assert meta["config"]["ceiling"] is True
    labels = [r["variant"] if r["variant"] == "transformers" else f"{r['variant']} k={r['k']}"
              for r in rows]
    assert labels == LABELS * 4  # batch 1 (request by request), then batch 3; two rounds each
    assert [r["batch_size"] for r in rows] == [1] * 6 + [3] * 6
    for r in rows:
        assert r["output_tokens"] == len(BENCH_PROMPTS) * MAX_TOKENS
        assert (r["outputs_equal"], r["outputs_compared"]) == (len(BENCH_PROMPTS),) * 2
    perfect = [r for r in rows if r["variant"] == "perfect drafts"]
    for r in perfect:
        # 6 tokens a request: the prefill step emits one, then each step verifies 2 drafts
        # and emits 3 while room is left (3, then 2 with 1 draft): 3 drafts a request
        assert (r["drafted"], r["accepted"], r["draft_steps"]) == (3 * len(BENCH_PROMPTS),) * 2 \
            + (2 * len(BENCH_PROMPTS),)
        assert r["acceptance_rate"] == 1.0
    drafter = [r for r in rows if r["variant"] == "engine" and r["k"] == 2]
    assert all(r["accepted"] < r["drafted"] for r in drafter)  # a random drafter: mostly wrong


def test_report_gives_the_ceiling_and_plots_it(ceiling_dir: Path, tmp_path: Path) -> None:
    report = (ceiling_dir / "report.md").read_text()
    assert "**PASS**: all 12 engine runs produced exactly the same tokens" in report
    assert "| 3 | perfect drafts k=2 | " in report
    assert "Ceiling: perfect drafts over k=0" in report
    assert "perfect drafts (`--ceiling`)" in report
    # the acceptance table is the drafter's own: the perfect drafts are not in it
    rows, _ = read_bench_parquet(ceiling_dir / "bench.parquet")
    drafted = sum(r["drafted"] for r in rows if r["variant"] == "engine")
    assert f"| 2 | {drafted:,} | " in report
    speedup = plot_speedup(summarize(rows), tmp_path / "s.png")
    assert speedup is not None and sorted(speedup) == ["batch 1", "batch 1, perfect drafts",
                                                       "batch 3", "batch 3, perfect drafts"]
    assert [x for x, _ in speedup["batch 3, perfect drafts"]] == [0.0, 2.0]
    assert speedup["batch 3, perfect drafts"][0] == (0.0, 1.0)


def test_ceiling_needs_a_drafting_k(tiny_model_dir: Path, prompts_file: Path,
                                    tmp_path: Path) -> None:
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                           "--out", str(tmp_path), "--k", "0", "--ceiling")
    assert result.exit_code == 2
    assert result.stderr == ("error: --ceiling needs k = 0 (its outputs are the perfect drafts) "
                             "and a k > 0 in --k, got --k 0\n")


def test_k0_always_runs(tiny_model_dir: Path, prompts_file: Path, tmp_path: Path) -> None:
    """--k without 0 gets it: every ratio of the report is taken against k = 0 (the missing
    drafter is refused only after, naming the k values it was asked for)."""
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                           "--out", str(tmp_path), "--k", "2,1")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "--k 2,1: adding k = 0 (the engine without drafter), which every ratio is taken against",
        f"error: --k 1,2 needs a drafter, and none ships for {tiny_model_dir}; pass --drafter "
        "PATH, --drafter random, or --k 0"]

"""`eaglebatch bench --draft-max-batch N`: the k > 0 variants draft only in steps of at most N
requests, as `generate` does (by default the bench drafts at every batch size)."""

from __future__ import annotations

from pathlib import Path

from pipeline.bench.bench_file import read_bench_parquet
from tests.pipeline.bench.conftest import MAX_TOKENS, run_bench_cli


def test_k_variants_draft_only_in_steps_of_at_most_n_requests(
        tiny_model_dir: Path, tiny_drafter_dir: Path, prompts_file: Path, tmp_path: Path,
        one_thread_module: None) -> None:
    out = tmp_path / "report"
    result = run_bench_cli(
        "--model", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
        "--prompts", str(prompts_file), "--num-prompts", "3", "--out", str(out),
        "--batch-sizes", "1,3", "--k", "0,2", "--max-tokens", str(MAX_TOKENS), "--repeats", "1",
        "--baseline", "none", "--ignore-eos", "--draft-confidence", "0",
        "--draft-max-batch", "2")
    assert result.exit_code == 0, result.output
    rows, meta = read_bench_parquet(out / "bench.parquet")
    assert meta["config"]["draft_max_batch"] == 2
    drafting = {r["batch_size"]: r for r in rows if r["k"] == 2}
    # batch 3: the three requests start and (EOS ignored) end together, so every step has 3
    # sampling requests, more than 2: no drafts at all. Batch 1: every step drafts.
    assert (drafting[3]["drafted"], drafting[3]["draft_steps"]) == (0, 0)
    assert drafting[1]["drafted"] > 0
    assert all(r["output_tokens"] == 3 * MAX_TOKENS for r in rows)
    report = (out / "report.md").read_text()
    assert "**PASS**: all 4 engine runs produced exactly the same tokens" in report
    assert "greedy requests draft only in steps of at most 2 requests (`--draft-max-batch`" \
        in report


def test_draft_max_batch_defaults_to_any_batch(bench_dir: Path) -> None:
    _, meta = read_bench_parquet(bench_dir / "bench.parquet")
    assert meta["config"]["draft_max_batch"] is None
    assert "`--draft-max-batch`" not in (bench_dir / "report.md").read_text()

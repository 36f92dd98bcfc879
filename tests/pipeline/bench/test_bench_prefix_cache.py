"""`eaglebatch bench` caches prompt prefixes as `generate` does, within a run only: each engine's
cache is emptied before each run, so a repeat (or the warm-up) never serves the next run's
prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench.bench_file import read_bench_parquet
from pipeline.bench.workload import build_workload, read_prompts
from runtime.loader import load_tokenizer
from tests.pipeline.bench.conftest import MAX_TOKENS, run_bench_cli
from tests.pipeline.helpers import write_parquet

SHARED = "Answer in one short sentence, as plainly as you can, the question that follows: "
QUESTIONS = ["why is the sky blue?", "what is bread made of?", "who wrote Hamlet?"]
BLOCK = 16  # EngineConfig.block_size


def _shared_tokens(prompts: Path, model_dir: Path) -> tuple[int, int]:
    """The prompts' common prefix in whole KV blocks, in tokens, and all their tokens."""
    workload = build_workload(read_prompts(str(prompts), "prompt", None), "prompt", None,
                              load_tokenizer(model_dir), 4096, MAX_TOKENS, True, False)
    first = workload.prompts[0]
    common = min(next((i for i, (a, b) in enumerate(zip(first, p, strict=False)) if a != b),
                      min(len(first), len(p))) for p in workload.prompts)
    return common // BLOCK * BLOCK, sum(workload.prompt_lengths)


@pytest.mark.parametrize("option", [None, "--no-prefix-caching"])
def test_a_run_reuses_its_own_shared_prefix_and_never_an_earlier_runs(
        option: str | None, tiny_model_dir: Path, tiny_drafter_dir: Path, tmp_path: Path,
        one_thread_module: None) -> None:
    prompts = write_parquet(tmp_path / "prompts.parquet",
                            {"prompt": [SHARED + q for q in QUESTIONS]})
    shared, total = _shared_tokens(prompts, tiny_model_dir)
    assert shared >= 2 * BLOCK  # a test that can fail: whole blocks are shared
    out = tmp_path / "report"
    result = run_bench_cli(
        "--model", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
        "--prompts", str(prompts), "--out", str(out), "--batch-sizes", "1,3", "--k", "0,2",
        "--max-tokens", str(MAX_TOKENS), "--repeats", "2", "--baseline", "none",
        "--draft-confidence", "0", *([option] if option else []))
    assert result.exit_code == 0, result.output
    rows, meta = read_bench_parquet(out / "bench.parquet")
    report = (out / "report.md").read_text()
    assert "**PASS**: all 8 engine runs produced exactly the same tokens" in report
    if option:
        assert meta["config"]["prefix_caching"] is False
        assert "- prefix caching off (`--no-prefix-caching`): every request computed its " \
            "whole prompt" in report
        return
    assert meta["config"]["prefix_caching"] is True
    # The first request computes the shared blocks, the two after it reuse them (at batch 3
    # too, where they start in the same step: each layer writes a step's KV before any of its
    # queries reads). The warm-up request (the first prompt) had cached them as well, so without
    # the emptying before each run all three would hit.
    assert meta["prefix_cache_hits"] == {"1": [2 * shared, total], "3": [2 * shared, total]}
    served = f"{2 * shared} prompt tokens of {total} ({2 * shared / total:.0%})"
    assert (f"served from the cache in the first k = 0 run: batch 1: {served}; batch 3: "
            f"{served}") in report

"""On CUDA the bench also measures peak GPU memory and the decode step against the
memory-bandwidth floor (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench.bench_file import read_bench_parquet
from tests.pipeline.bench.conftest import run_bench_cli


@pytest.mark.gpu
def test_cuda_bench_reports_gpu_memory_and_the_bandwidth_floor(
        tiny_model_dir: Path, tiny_drafter_dir: Path, prompts_file: Path, tmp_path: Path) -> None:
    result = run_bench_cli(
        "--model", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--prompts",
        str(prompts_file), "--out", str(tmp_path), "--device", "cuda", "--dtype", "bfloat16",
        "--batch-sizes", "1,2", "--k", "0,2", "--max-tokens", "16", "--repeats", "1")
    assert result.exit_code == 0, result.output
    rows, meta = read_bench_parquet(tmp_path / "bench.parquet")
    assert meta["copy_bandwidth_bytes_per_s"] > 1e10 and meta["dtype"] == "bfloat16"
    for r in rows:
        assert r["peak_gpu_bytes"] > 0
        if r["variant"] == "engine":
            assert r["decode_step_s"] > 0 and r["bandwidth_floor_s"] > 0
            assert r["outputs_equal"] == r["outputs_compared"]
    report = (tmp_path / "report.md").read_text()
    assert "## Decode step against the memory-bandwidth floor" in report
    assert "peak GPU MiB" in report

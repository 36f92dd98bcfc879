"""A bench killed outright leaves its scratch directory (random weights) in --out; the next
bench into the same --out removes it and says so."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from jobs.cli import main
from tests.pipeline.bench.conftest import run_bench_cli


def test_a_killed_bench_scratch_is_removed_by_the_next_bench(
        tiny_model_dir: Path, prompts_file: Path, tmp_path: Path,
        one_thread_module: None) -> None:
    out = tmp_path / "report"
    stale = out / ".bench-models-k1ll3d" / "model"
    stale.mkdir(parents=True)
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"\0" * (1 << 20))
    keep = out / "notes.txt"  # the user's own files stay
    keep.write_text("mine")
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                           "--out", str(out), "--batch-sizes", "1", "--k", "0",
                           "--max-tokens", "2", "--repeats", "1", "--baseline", "none")
    assert result.exit_code == 0, result.output
    assert not (out / ".bench-models-k1ll3d").exists()
    assert ("bench: removed .bench-models-k1ll3d (1 MiB of random weights), left in --out by "
            "a bench that was killed") in result.stderr
    assert keep.read_text() == "mine"
    # into a file or pipe (here, as in a log): lines, not a progress bar's "\r" redraws
    assert "\r" not in result.stderr and "B=1   engine k=0" in result.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_report_names_a_killed_bench_scratch(tmp_path: Path) -> None:
    """A bench killed before its first round leaves only its scratch: `report` said 'not the
    output of an eaglebatch job or bench' and nothing of the gigabytes beside it."""
    stale = tmp_path / ".bench-models-k1ll3d" / "model"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == (  # (a bench of real weights leaves an empty one: "empty")
        f"note: {tmp_path / '.bench-models-k1ll3d'} (3 MiB of random weights) was left by a "
        "bench that was killed: delete it, or the next bench into this directory removes it\n"
        f"error: {tmp_path} has no manifest.json, stats.parquet or bench.parquet: not the "
        "output of an eaglebatch job or bench\n")

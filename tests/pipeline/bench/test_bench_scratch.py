"""A bench killed outright leaves its scratch directory (random weights) in --out; the next
bench into the same --out removes it and says so."""

from __future__ import annotations

from pathlib import Path

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
    assert ("bench: removed .bench-models-k1ll3d (0.0 GiB of random weights), left in --out by "
            "a bench that was killed") in result.stderr
    assert keep.read_text() == "mine"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []

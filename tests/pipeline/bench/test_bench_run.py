"""`eaglebatch bench` end to end on the tiny random llama with a random 2-layer EAGLE drafter."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
from matplotlib.image import imread

from pipeline.bench.aggregate import acceptance_by_k, summarize
from pipeline.bench.bench_file import read_bench_parquet
from pipeline.bench.engine_run import EngineVariant, engine_config
from pipeline.bench.metrics import BENCH_SCHEMA, Agreement, bench_row
from pipeline.bench.plots import plot_acceptance, plot_speedup, plot_throughput
from pipeline.bench.runner import turns
from pipeline.bench.workload import Workload
from runtime.config import EngineConfig
from runtime.huge_pages import huge_pages_available
from tests.pipeline.bench.conftest import (
    BATCH_SIZES,
    BENCH_PROMPTS,
    KS,
    MAX_TOKENS,
    REPEATS,
    run_bench_cli,
)
from tests.pipeline.helpers import write_parquet

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOT_FILES = ("tokens_per_s_by_batch.png", "speedup_by_k.png", "acceptance_by_position.png")
LABELS = ["transformers", "engine k=0", "engine k=2"]


def _label(row: dict) -> str:
    return row["variant"] if row["variant"] == "transformers" else f"engine k={row['k']}"


def test_bench_parquet_has_one_row_per_run_in_interleaved_order(bench_dir: Path) -> None:
    table = pq.read_table(bench_dir / "bench.parquet")
    assert [(f.name, f.type) for f in table.schema] == [(f.name, f.type) for f in BENCH_SCHEMA]
    rows = table.to_pylist()
    assert [r["order"] for r in rows] == list(range(len(BATCH_SIZES) * REPEATS * 3))
    expected = [(b, repeat, label) for b in BATCH_SIZES for repeat in range(REPEATS)
                for label in LABELS]
    assert [(r["batch_size"], r["repeat"], _label(r)) for r in rows] == expected


def test_bench_measures_every_run(bench_dir: Path) -> None:
    rows, meta = read_bench_parquet(bench_dir / "bench.parquet")
    assert meta["prompts"] == len(BENCH_PROMPTS) and meta["random_weights"] is False
    assert meta["config"]["batch_sizes"] == list(BATCH_SIZES)
    for r in rows:
        assert r["requests"] == len(BENCH_PROMPTS)
        assert 0 < r["output_tokens"] <= len(BENCH_PROMPTS) * MAX_TOKENS
        assert r["output_tokens_per_s"] == r["output_tokens"] / r["wall_seconds"]
        assert 0 < r["ttft_p50_s"] <= r["latency_p99_s"] <= r["wall_seconds"]
        assert r["latency_p50_s"] <= r["latency_p99_s"]
        assert r["peak_rss_bytes"] > 0 and r["peak_gpu_bytes"] is None
    for r in rows:
        if r["variant"] == "engine" and r["k"] == 2:
            assert r["drafted"] > 0 and len(r["accepted_per_position"]) == 2
            assert r["draft_steps"] > 0 and r["mean_acceptance_length"] >= 1.0
        else:  # no draft positions (k = 0 engines had [0])
            assert r["drafted"] == 0 and r["acceptance_rate"] is None
            assert r["accepted_per_position"] == []


def test_engine_variants_agree_and_the_report_says_so(bench_dir: Path) -> None:
    rows, _ = read_bench_parquet(bench_dir / "bench.parquet")
    engine_rows = [r for r in rows if r["variant"] == "engine"]
    assert len(engine_rows) == len(BATCH_SIZES) * len(KS) * REPEATS
    for r in engine_rows:
        assert (r["outputs_equal"], r["outputs_compared"]) == (len(BENCH_PROMPTS),) * 2
        assert r["first_divergence"] is None
    assert len({r["output_tokens"] for r in engine_rows}) == 1
    report = (bench_dir / "report.md").read_text()
    assert "**PASS**: all 8 engine runs produced exactly the same tokens as engine k=0 at " \
           "batch 1 (first run) for all 4 requests." in report


def test_report_has_median_and_ratio_tables(bench_dir: Path) -> None:
    report = (bench_dir / "report.md").read_text()
    for b in BATCH_SIZES:
        for label in LABELS:
            assert f"| {b} | {label} | " in report
    assert "Engine without drafter over transformers" in report
    assert "| batch | k=2 |" in report and "| batch | best k | tokens/s |" in report
    assert "| k | drafted | acceptance rate | mean acceptance length | pos 1 | pos 2 |" in report
    for name in PLOT_FILES:
        assert f"]({name})" in report
    assert "Random weights" not in report and "bandwidth floor" not in report
    pages = ("- the engines' packed weights in transparent huge pages\n" if huge_pages_available()
             else "- the engines' packed weights in ordinary 4 KiB pages")
    assert pages in report


def test_plots_are_pngs_with_data(bench_dir: Path, tmp_path: Path) -> None:
    for name in PLOT_FILES:
        data = (bench_dir / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE
        pixels = imread(bench_dir / name)[..., :3]
        blue = ((abs(pixels - [0.12, 0.47, 0.71]) < 0.05).all(axis=-1)).sum()
        assert blue > 100, f"{name}: no line in the first series colour"
    rows, _ = read_bench_parquet(bench_dir / "bench.parquet")
    summaries = summarize(rows)
    throughput = plot_throughput(summaries, tmp_path / "t.png")
    assert throughput is not None and sorted(throughput) == sorted(LABELS)
    assert all([x for x, _ in points] == [1.0, 3.0] for points in throughput.values())
    assert all(y > 0 for points in throughput.values() for _, y in points)
    speedup = plot_speedup(summaries, tmp_path / "s.png")
    assert speedup is not None and sorted(speedup) == ["batch 1", "batch 3"]
    assert all([x for x, _ in p] == [0.0, 2.0] and p[0][1] == 1.0 for p in speedup.values())
    acceptance = plot_acceptance({"k=2": acceptance_by_k(rows)[2]}, tmp_path / "a.png")
    assert acceptance is not None and [x for x, _ in acceptance["k=2"]] == [1.0, 2.0]


def test_report_command_redraws_a_bench_report(bench_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from jobs.cli import main

    result = CliRunner().invoke(main, ["report", str(bench_dir), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.md").read_text() == (bench_dir / "report.md").read_text()
    assert all((tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE for name in PLOT_FILES)


def test_speculative_k_without_a_drafter_is_a_user_error(
        tiny_model_dir: Path, prompts_file: Path, tmp_path: Path) -> None:
    result = run_bench_cli("--model", str(tiny_model_dir), "--drafter", "none", "--prompts",
                           str(prompts_file), "--out", str(tmp_path), "--k", "0,1")
    assert result.exit_code == 2
    assert result.stderr == ("error: --drafter none: the k > 0 variants of --k 0,1 need a "
                             "drafter (--k's default is 0,1,2,3,5); pass --k 0 to measure "
                             "the engine without one\n")


def test_bad_prompt_files_are_user_errors_naming_file_and_column(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    numbers = write_parquet(tmp_path / "numbers.parquet", {"prompt": [1, 2]})
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text("not parquet")
    expected = {
        numbers: f"error: --prompts {numbers}: column 'prompt' is int64, expected string "
                 "(--prompt-column)\n",
        not_parquet: f"error: --prompts {not_parquet}: cannot read it as Parquet (",
    }
    for path, message in expected.items():
        result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(path),
                               "--out", str(tmp_path / "r"), "--k", "0")
        assert result.exit_code == 2
        assert result.stderr.startswith(message), result.stderr
    other = write_parquet(tmp_path / "other.parquet", {"text": ["hi"]})
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(other),
                           "--out", str(tmp_path / "r"), "--k", "0")
    assert result.stderr == (f"error: --prompts {other} has no column 'prompt' (--prompt-column; "
                             "columns: text)\n")
    # checked before the model: a preset that would take minutes to build is never built
    missing = tmp_path / "missing.parquet"
    result = run_bench_cli("--model", "random:llama-3-8b", "--prompts", str(missing),
                           "--out", str(tmp_path / "r"), "--k", "0")
    assert result.stderr == f"error: --prompts {missing}: no such file\n"
    assert not (tmp_path / "r").exists()
    result = run_bench_cli("--prompts", f"{tmp_path}/*.parquet", "--out", str(tmp_path / "r"))
    assert result.stderr == (f"error: --prompts {tmp_path}/*.parquet: no such file; bench reads "
                             "one Parquet file, not a glob\n")


def test_a_jobs_output_dir_is_refused_as_out(tiny_model_dir: Path, prompts_file: Path,
                                             tmp_path: Path) -> None:
    """A bench report would replace the job's report.md and plots."""
    for name in ("manifest.json", "stats.parquet"):
        job = tmp_path / name.split(".")[0]
        job.mkdir()
        (job / name).write_text("{}")
        result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                               "--out", str(job), "--k", "0")
        assert result.exit_code == 2
        assert result.stderr == (f"error: --out {job} holds a job's {name}: a bench report "
                                 "there would replace the job's report; pick another directory\n")
        assert sorted(p.name for p in job.iterdir()) == [name]


def test_unusable_drafters_and_out_paths_are_user_errors(
        tiny_model_dir: Path, tiny_drafter_dir: Path, prompts_file: Path, tmp_path: Path) -> None:
    def bench(*args: str) -> tuple[int, str]:
        result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                               "--batch-sizes", "1", "--max-tokens", "2", "--repeats", "1",
                               "--baseline", "none", *args)
        return result.exit_code, result.stderr

    out = str(tmp_path / "r")
    # a plain model where a drafter belongs: refused when its engine is built
    code, stderr = bench("--drafter", str(tiny_model_dir), "--k", "0,1", "--out", out)
    assert code == 2
    assert stderr.splitlines()[-1] == (  # after the bench's opening line
        f"error: cannot load --model {tiny_model_dir} / --drafter {tiny_model_dir}: drafter "
        f"{tiny_model_dir}: no fc.weight; not an EAGLE checkpoint")
    # a drafter whose weights file is damaged: refused before any engine is built
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_drafter_dir, damaged)
    weights = next(damaged.glob("*.safetensors"))
    weights.write_bytes(b"\x08" + b"\0" * 7 + b"garbage!")
    code, stderr = bench("--drafter", str(damaged), "--k", "0,1", "--out", out)
    assert code == 2
    assert stderr.startswith(f"error: --drafter {damaged}: drafter {damaged}: cannot read "
                             f"{weights.name} (")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    code, stderr = bench("--k", "0", "--out", str(a_file))
    assert (code, stderr) == (2, f"error: --out {a_file}: cannot make it a directory (File "
                                 "exists)\n")


def test_a_run_in_parts_counts_only_its_own_time(tiny_model_dir: Path,
                                                 one_thread_module: None) -> None:
    """At batch size 1 the bench runs every variant request by request in turn; a run's parts
    add up to the run, and the time between them (the other variants) is left out."""
    workload = Workload([(5, 6, 7), (8, 9), (10, 11, 12, 13)], [5, 4, 6], True, 0)
    base = EngineConfig(kv_cache_memory=16 << 20)
    variant = EngineVariant(engine_config(tiny_model_dir, None, 0, 1, workload, base), 0, None)
    whole = variant.run(workload)
    record = None
    start = time.perf_counter()
    for part in turns(workload, 1):
        record = variant.run(part, record)
        time.sleep(0.5)  # another variant's turn
    elapsed = time.perf_counter() - start
    assert record is not None
    assert record.outputs == whole.outputs and list(record.outputs) == ["0", "1", "2"]
    assert [len(ids) for ids in record.outputs.values()] == [5, 4, 6]
    row = bench_row(record, 0, 0, Agreement(whole.outputs, record.outputs))
    assert row["outputs_equal"] == 3 and row["requests"] == 3
    assert 0 < row["wall_seconds"] <= elapsed - 1.5  # the 1.5 s asleep are left out
    finished = sorted(record.finished_at.values())
    assert finished[-1] <= record.end and record.t0 < finished[0]
    assert len(record.decode_steps) == len(record.decode_contexts) > 0

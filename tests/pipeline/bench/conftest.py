"""One small bench on the tiny random checkpoint, run once and read by several tests; the
`bench` and `report` commands run in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from jobs.cli import main
from tests.drafter_fixtures import make_random_drafter
from tests.pipeline.helpers import write_parquet

BENCH_PROMPTS = ["Paris is the capital of", "The quick brown fox", "To bake bread, mix flour",
                 "The sky is blue because"]
BATCH_SIZES = (1, 3)
KS = (0, 2)
REPEATS = 2
MAX_TOKENS = 6
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_bench_cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["bench", *args])


def _report(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["report", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench-prompts") / "prompts.parquet"
    return write_parquet(path, {"prompt": BENCH_PROMPTS})


@pytest.fixture(scope="module")
def tiny_drafter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("bench-drafter"))


@pytest.fixture(scope="module")
def bench_dir(tiny_model_dir: Path, tiny_drafter_dir: Path, prompts_file: Path,
              tmp_path_factory: pytest.TempPathFactory, one_thread_module: None) -> Path:
    """transformers + engine k=0 + engine k=2 at batch sizes 1 and 3, two rounds each."""
    out = tmp_path_factory.mktemp("bench") / "report"
    result = run_bench_cli(
        "--model", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
        "--prompts", str(prompts_file), "--out", str(out),
        "--batch-sizes", ",".join(map(str, BATCH_SIZES)), "--k", ",".join(map(str, KS)),
        "--max-tokens", str(MAX_TOKENS), "--repeats", str(REPEATS),
        "--draft-confidence", "0")  # a random drafter's confidence means nothing: draft k always
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {out / 'report.md'}"
    return out

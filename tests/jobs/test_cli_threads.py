"""--threads reaches torch before the engine runs."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import torch
from click.testing import CliRunner

from jobs.cli import main
from tests.pipeline.helpers import write_parquet


def test_threads_option_sets_torch_threads(tmp_path: Path, tiny_model_dir: Path) -> None:
    before = torch.get_num_threads()
    source = tmp_path / "in.parquet"
    write_parquet(source, {"id": ["a", "b"], "prompt": ["Paris is", "Once upon a time"]})
    try:
        torch.set_num_threads(2)
        result = CliRunner().invoke(main, [
            "generate", str(source), str(tmp_path / "out"), "--model", str(tiny_model_dir),
            "--kv-cache-memory", "16MiB", "--max-tokens", "3", "--threads", "1"])
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 1
        assert pq.read_table(tmp_path / "out" / "part-00000.parquet").num_rows == 2
    finally:
        torch.set_num_threads(before)

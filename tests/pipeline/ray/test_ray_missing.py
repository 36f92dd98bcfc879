"""--runner ray without Ray installed, and Ray options without --runner ray: exit 2, one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobs.cli import main
from tests.pipeline.helpers import write_parquet


def _generate(tmp_path: Path, model_dir: Path, *args: str) -> tuple[int, str]:
    path = write_parquet(tmp_path / "in.parquet", {"id": ["x"], "prompt": ["Berlin is"]})
    result = CliRunner().invoke(main, ["generate", str(path), str(tmp_path / "out"), "--model",
                                       str(model_dir), "--max-tokens", "2", *args])
    return result.exit_code, result.stderr


def test_runner_ray_without_ray_says_how_to_install_it(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    monkeypatch.delitem(sys.modules, "pipeline.ray_runner", raising=False)
    code, err = _generate(tmp_path, tiny_model_dir, "--runner", "ray")
    assert code == 2
    assert err.startswith("error: --runner ray needs Ray, which cannot be imported (")
    assert err.endswith("); install it with: pip install 'eaglebatch[ray]'\n")
    assert not (tmp_path / "out").exists()  # refused before anything was touched


@pytest.mark.parametrize("option", [["--num-workers", "2"], ["--ray-address", "auto"],
                                    ["--gpus-per-worker", "1"]])
def test_ray_options_need_runner_ray(tmp_path: Path, tiny_model_dir: Path,
                                     option: list[str]) -> None:
    code, err = _generate(tmp_path, tiny_model_dir, *option)
    assert (code, err) == (2, f"error: {option[0]} is an option of --runner ray\n")

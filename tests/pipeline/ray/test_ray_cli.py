"""`eaglebatch generate --runner ray` with no Ray running: the command starts a local Ray instance
sized to this machine, writes what `--runner local` writes, and leaves no Ray process behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

pytest.importorskip("ray.exceptions")  # (a bare "ray" would find tests/pipeline/ray here)

import ray  # noqa: E402

from jobs.cli import main  # noqa: E402
from tests.pipeline.ray.ray_helpers import (  # noqa: E402
    IDS,
    parts,
    ray_processes,
    stats_without_timing,
    wait_until_gone,
    write_inputs,
)


def _generate(model_dir: Path, inputs: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(inputs), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB",
                                     "--shard-rows", "2", "--max-tokens", "6", *args])


def test_runner_ray_starts_and_stops_its_own_ray(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert not ray.is_initialized()
    inputs = write_inputs(tmp_path / "in")
    before = ray_processes()
    result = _generate(tiny_model_dir, inputs, tmp_path / "ray", "--runner", "ray")
    assert result.exit_code == 0, result.output
    assert not ray.is_initialized()
    assert wait_until_gone(ray_processes() - before) == set()
    sized = re.search(r"ray: 1 worker \((\d+) CPUs?, 0 GPUs each\)", result.stderr)
    assert sized is not None, result.stderr  # one worker, every CPU Ray found on this machine
    assert result.stdout.startswith("done: 8 rows (1 error), ")
    # the bar's last line has the tokens of shards shorter than a progress poll (it read 0.0)
    assert float(re.findall(r"([\d.]+) tok/s\]", result.stderr)[-1]) > 0
    # and the prompt tokens of their rows, which the workers count as rows finish
    assert float(re.findall(r"in ([\d.]+), out", result.stderr)[-1]) > 0

    threads = torch.get_num_threads()
    torch.set_num_threads(int(sized.group(1)))  # as the worker (Ray sets its OMP_NUM_THREADS)
    try:
        local = _generate(tiny_model_dir, inputs, tmp_path / "local")
    finally:
        torch.set_num_threads(threads)
    assert local.exit_code == 0, local.output
    expected, got = parts(tmp_path / "local"), parts(tmp_path / "ray")
    assert list(got) == list(expected) and len(got) == 5
    for name, table in expected.items():
        assert got[name].equals(table), name
    assert sum((t.column("id").to_pylist() for t in got.values()), []) == IDS
    assert stats_without_timing(tmp_path / "ray") == stats_without_timing(tmp_path / "local")

"""What the `eaglebatch generate` CLI tests share: seven prompts, the command run in-process on a
model with a 16 MiB KV cache, and a job run with and without the default model's drafter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from jobs.cli import main
from runtime.config import DEFAULT_MODEL
from tests.pipeline.helpers import read_parts

PROMPTS = ["Paris is the capital of", "The quick brown fox", "To bake bread, mix flour",
           "The sky is blue because", "Berlin is", "Once upon a time", "Numbers: 0 1 2 3"]


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB", *args])


def rows_alike_with_the_drafter(generate: Callable[..., Result], input_path: Path, out: Path,
                                *args: str) -> list[dict[str, Any]]:
    """The job's rows with --drafter none; the shipped drafter (auto) gives the same tokens and
    text, and has some of its drafts accepted. generate(model, input, out_dir, *args)."""
    rows = {}
    for drafter in ("auto", "none"):
        result = generate(DEFAULT_MODEL, input_path, out / drafter, "--drafter", drafter, *args)
        assert result.exit_code == 0, result.output
        rows[drafter] = read_parts(out / drafter).to_pylist()
    assert [(r["completion_token_ids"], r["completion"]) for r in rows["auto"]] == [
        (r["completion_token_ids"], r["completion"]) for r in rows["none"]]
    assert sum(r["num_accepted"] for r in rows["auto"]) > 0
    return rows["none"]

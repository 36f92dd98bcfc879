"""What the `eaglebatch generate` CLI tests share: seven prompts, and the command run in-process
on a model with a 16 MiB KV cache."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from jobs.cli import main

PROMPTS = ["Paris is the capital of", "The quick brown fox", "To bake bread, mix flour",
           "The sky is blue because", "Berlin is", "Once upon a time", "Numbers: 0 1 2 3"]


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB", *args])

"""`--help` explains every option of every command."""

from __future__ import annotations

import click
from click.testing import CliRunner

from jobs.cli import main


def test_every_option_of_every_command_has_help_text() -> None:
    missing = [f"{name} --{param.name}" for name, cmd in main.commands.items()
               for param in cmd.params
               if isinstance(param, click.Option) and not param.hidden and not param.help]
    assert missing == []
    assert sorted(main.commands) == ["bench", "generate", "report", "train-drafter"]


def test_bench_help_lists_the_random_presets() -> None:
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "llama-3-8b, llama-3.2-1b, qwen2-0.5b, qwen3-0.6b, qwen3-8b, smollm2-135m" in text

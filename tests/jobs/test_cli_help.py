"""`--help` explains every option of every command."""

from __future__ import annotations

import click
from click.testing import CliRunner

from jobs.cli import main
from jobs.generate_config import draft_max_batch
from runtime.config import CLI_DRAFT_MAX_BATCH


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
    assert ("llama-2-7b, llama-3-8b, llama-3.2-1b, mistral-7b, qwen2-0.5b, qwen2.5-7b, "
            "qwen3-0.6b, qwen3-8b, smollm2-135m) or random:<config.json or directory holding "
            "one>") in text


def test_draft_max_batch_defaults_to_1_with_q4_panels_else_4() -> None:
    """With --q4-panels drafting loses from batch 4 (0.89x), so unless --draft-max-batch is
    given, only steps of one request draft; 0 still means any batch."""
    seen = {}
    for args in ([], ["--q4-panels"], ["--q4-panels", "--draft-max-batch", "3"],
                 ["--draft-max-batch", "0"]):
        ctx = main.commands["generate"].make_context(
            "generate", ["in.parquet", "out", *args], resilient_parsing=True)
        seen[" ".join(args)] = draft_max_batch(ctx.params)
    assert seen == {"": CLI_DRAFT_MAX_BATCH, "--q4-panels": 1,
                    "--q4-panels --draft-max-batch 3": 3, "--draft-max-batch 0": None}
    assert CLI_DRAFT_MAX_BATCH == 4

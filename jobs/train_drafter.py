"""`eaglebatch train-drafter`: train an EAGLE drafter for a target model on its own answers."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from jobs.options import finite, not_blank
from pipeline.config import one_line
from pipeline.schema import is_messages_type, is_string, python_values
from pipeline.stages.tokenize import clean_messages, messages_problem
from runtime.config import DEFAULT_MODEL
from runtime.loader import load_model_config, resolve_model
from runtime.speculative.train_data import Prompt
from runtime.speculative.train_init import load_init_drafter
from runtime.speculative.train_job import TrainDrafterJob, TrainingInterrupted, run_train_drafter
from runtime.speculative.training import TrainConfig

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


def parse_duration(text: str) -> float:
    """'45m' -> 2700.0, '1.5h' -> 5400.0, '90' or '90s' -> 90.0 seconds (more than 0)."""
    match = _DURATION.match(text)
    if match is None:
        raise click.BadParameter(f"cannot read duration {text!r}; use e.g. 45m, 2h or 600s",
                                 param_hint="--time-budget")
    seconds = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]
    if seconds <= 0:
        raise click.BadParameter(f"{text!r} leaves no time to train; give more than 0",
                                 param_hint="--time-budget")
    return seconds


def read_prompts(path: Path, limit: int | None = None, option: str = "--prompts",
                 prompt_column: str = "prompt", messages_column: str | None = None
                 ) -> tuple[tuple[str, ...], tuple[Prompt, ...]]:
    """(ids, prompts) from a Parquet file: its prompt column (strings), or with messages_column
    its chats (tuples of {role, content, ...} dicts); ids from its `id` column, else row numbers.
    Rows that cannot be prompts (null, blank, malformed chats, not UTF-8) are left out, said."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise click.BadParameter(f"{path}: cannot read it as Parquet "
                                 f"({one_line(exc)})", param_hint=option) from None
    column = messages_column or prompt_column
    which = "--messages-column" if messages_column else "--prompt-column"
    if column not in table.schema.names:
        chats = [f.name for f in table.schema if is_messages_type(f.type)]
        hint = (f"; chat column(s) {', '.join(chats)}: --messages-column"
                if chats and not messages_column else "")
        raise click.BadParameter(f"{path} has no {column!r} column ({which}; columns: "
                                 f"{', '.join(table.schema.names)}{hint})", param_hint=option)
    kind = table.schema.field(column).type
    if messages_column and not (is_messages_type(kind) or pa.types.is_null(kind)):
        raise click.BadParameter(f"{path}: column {column!r} is {kind}, not "
                                 f"list<struct<role: string, content: string>> ({which})",
                                 param_hint=option)
    if not messages_column and not (is_string(kind) or pa.types.is_null(kind)):
        hint = " (chat messages: --messages-column)" if is_messages_type(kind) else ""
        raise click.BadParameter(f"{path}: column {column!r} is {kind}, not string{hint}",
                                 param_hint=option)
    values = python_values(table.column(column))  # not UTF-8: its UnicodeDecodeError
    if bad := [row for row, value in enumerate(values) if isinstance(value, UnicodeDecodeError)]:
        click.echo(f"note: {option} {path}: left out {len(bad)} prompt(s) that are not valid "
                   f"UTF-8 (row {bad[0]}{', ...' if len(bad) > 1 else ''})", err=True)
    ids = _ids(table, path, option)
    prompts: list[Prompt | None] = []
    malformed: list[tuple[int, str]] = []
    for row, value in enumerate(values):
        if isinstance(value, UnicodeDecodeError):
            prompts.append(None)
        elif messages_column:
            problem = messages_problem(value)
            if problem is not None:
                malformed.append((row, problem))
            prompts.append(None if problem else tuple(clean_messages(value)))
        else:
            prompts.append(value if isinstance(value, str) and value.strip() else None)
    if malformed:
        row, problem = malformed[0]
        click.echo(f"note: {option} {path}: left out {len(malformed)} chat(s) that cannot be "
                   f"rendered (row {row}: {problem}{', ...' if len(malformed) > 1 else ''})",
                   err=True)
    keep = [i for i, p in enumerate(prompts) if p is not None][:limit]
    if not keep:
        blank = "malformed chats" if messages_column else "null and blank prompts"
        raise click.BadParameter(f"{path} has no prompt to train on (rows: {len(prompts)}; "
                                 f"{blank} are left out)", param_hint=option)
    return tuple(ids[i] for i in keep), tuple(p for i in keep if (p := prompts[i]) is not None)


def _ids(table: pa.Table, path: Path, option: str) -> list[str]:
    """The `id` column's values as strings (refused when null or repeated), else row numbers."""
    if "id" not in table.schema.names:
        return [str(i) for i in range(table.num_rows)]
    raw_ids = table.column("id").to_pylist()
    seen: dict[str, int] = {}
    for row, value in enumerate(raw_ids):
        if value is None:
            raise click.BadParameter(f"{path}: column 'id' is null at row {row}",
                                     param_hint=option)
        if str(value) in seen:  # answers are kept by id: one would stand for both
            raise click.BadParameter(f"{path}: duplicate id {value!r} in column 'id' (rows "
                                     f"{seen[str(value)]} and {row}); ids must be unique",
                                     param_hint=option)
        if _SAMPLE_ID.search(str(value)):  # the ids of sampled answers: <prompt id>#s<n>
            raise click.BadParameter(f"{path}: id {value!r} at row {row} ends like a sampled "
                                     "answer's id ('<prompt id>#s<n>'); ids must not end in "
                                     "'#s' and a number", param_hint=option)
        seen[str(value)] = row
    return [str(i) for i in raw_ids]


_SAMPLE_ID = re.compile(r"#s[0-9]+$")


@click.command("train-drafter")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, callback=not_blank,
              help="Target: a built-in name, a Hugging Face checkpoint directory or a .gguf file.")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(exists=True,
              dir_okay=False, path_type=Path), help="Parquet file of training prompts (column "
              "'prompt', or chats with --messages-column); the target answers them itself.")
@click.option("--prompt-column", default="prompt", show_default=True,
              help="Column of --prompts (and --eval-prompts) holding the prompt strings.")
@click.option("--messages-column", default=None,
              help="Train on chats instead: a list<struct<role, content>> column of --prompts "
                   "(and --eval-prompts), rendered with the target's chat template; the target "
                   "answers each chat's next turn.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output directory: the drafter checkpoint, its model card, data and state. "
                   "Answers and features already in OUT/data (e.g. a copy of an earlier run's) "
                   "are kept and trained on, if the same target made them; a drafter already "
                   "in OUT is not overwritten.")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(1),
              help="Decoder layers of the drafter (initialised from the target's last layers).")
@click.option("--style", default="eagle1", show_default=True,
              type=click.Choice(["eagle1", "eagle3"]),
              help="eagle1: fed the target's last hidden state; eagle3: fed three of its "
                   "layers' inputs, with its own head over a draft vocabulary.")
@click.option("--num-speculative-tokens", default=3, show_default=True, type=click.IntRange(1),
              help="k: draft tokens per step in the evaluation (and unrolled in training).")
@click.option("--draft-vocab-size", default=None, type=click.IntRange(1),
              help="EAGLE-3: draft vocabulary (most frequent answer tokens); EAGLE-1: the "
                   "vocabulary of the token loss. Default min(8192, vocab).")
@click.option("--draft-head-size", default=None, type=click.IntRange(1),
              help="EAGLE-1: save the drafter with its own LM head of the N most frequent answer "
                   "tokens (rows of the target's head, with d2t); cheaper draft steps, drafts "
                   "limited to those tokens. Default: share the target's whole head.")
@click.option("--unroll", default=None, type=click.IntRange(1),
              help="Draft steps unrolled in training (training-time test); default k.")
@click.option("--max-steps", default=None, type=click.IntRange(1),
              help="Optimizer steps to train (give this, --time-budget, or both).")
@click.option("--time-budget", default=None, help="Training time, e.g. 45m (with or instead of "
              "--max-steps; training stops at whichever comes first).")
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint.pt (saved every 50 "
              "steps or 5 minutes, and on Ctrl-C) and OUT/data.")
@click.option("--max-answer-tokens", default=128, show_default=True, type=click.IntRange(1),
              help="Longest answer the target generates per training prompt.")
@click.option("--max-train-prompts", default=None, type=click.IntRange(1),
              help="Use only the first N training prompts.")
@click.option("--answer-samples", default=0, show_default=True, type=click.IntRange(0),
              help="Sampled answers per prompt besides the greedy one (seeded, so reruns draw "
                   "the same): more distinct text for the drafter from the same prompts.")
@click.option("--first-sample", default=1, show_default=True, type=click.IntRange(1),
              help="Number of the first sampled answer: with --answer-samples N the samples "
                   "#F..#F+N-1 are drawn (each seeded by prompt id and number), so a later round "
                   "of data (e.g. with --init-drafter) gets texts an earlier round did not.")
@click.option("--answer-temperature", default=0.7, show_default=True,
              type=click.FloatRange(0, min_open=True), callback=finite,
              help="Temperature of the sampled answers.")
@click.option("--data-dtype", default="bfloat16", show_default=True,
              type=click.Choice(["float32", "bfloat16"]),
              help="Target dtype while making answers (float32 is what generation runs in on "
                   "a CPU) and, unless --feature-dtype says otherwise, features.")
@click.option("--feature-dtype", default=None, type=click.Choice(["float32", "bfloat16"]),
              help="Target dtype of the teacher-forced features pass; default --data-dtype "
                   "(bfloat16 is several times faster on CPUs with AMX).")
@click.option("--init-drafter", default=None, type=click.Path(exists=True, file_okay=False,
              path_type=Path), help="Start from this drafter's weights (same style and layer "
              "count) instead of the target's last layers: fine-tuning, e.g. on more data. The "
              "optimizer and schedule start afresh.")
@click.option("--lr", default=5e-4, show_default=True, type=click.FloatRange(0, min_open=True),
              callback=finite,
              help="Peak AdamW learning rate (cosine decay to 5% after the warm-up).")
@click.option("--warmup-steps", default=20, show_default=True, type=click.IntRange(0),
              help="Steps of linear learning-rate warm-up.")
@click.option("--batch-tokens", default=4096, show_default=True, type=click.IntRange(64),
              help="Padded tokens per training batch (answers of similar length together).")
@click.option("--token-loss-weight", default=0.1, show_default=True,
              type=click.FloatRange(0, min_open=True), callback=finite,
              help="EAGLE-1: weight of the token cross-entropy next to the feature regression "
                   "(EAGLE-1 uses 0.1; larger values favour acceptance over feature fit).")
@click.option("--bf16-autocast/--no-bf16-autocast", default=False, show_default=True,
              help="Train under bf16 autocast (faster on CPUs with AMX/AVX512-BF16).")
@click.option("--threads", default=None, type=click.IntRange(1),
              help="torch CPU threads (default: torch's choice). On a busy machine fewer "
                   "threads than cores is often much faster.")
@click.option("--eval-prompts", default=None, type=click.Path(exists=True, dir_okay=False,
              path_type=Path), help="Held-out Parquet prompts to measure acceptance on at the end.")
@click.option("--num-eval", default=32, show_default=True, type=click.IntRange(1),
              help="How many of --eval-prompts (the first N) to measure acceptance on.")
@click.option("--eval-max-tokens", default=128, show_default=True, type=click.IntRange(1),
              help="Tokens generated per held-out prompt in that measurement.")
def train_drafter(model: str, prompts_path: Path, prompt_column: str,
                  messages_column: str | None, out_dir: Path, layers: int, style: str,
                  num_speculative_tokens: int, draft_vocab_size: int | None,
                  draft_head_size: int | None, unroll: int | None,
                  max_steps: int | None, time_budget: str | None, resume: bool,
                  max_answer_tokens: int, max_train_prompts: int | None,
                  answer_samples: int, first_sample: int, answer_temperature: float,
                  data_dtype: str,
                  feature_dtype: str | None,
                  init_drafter: Path | None, lr: float,
                  warmup_steps: int, batch_tokens: int, token_loss_weight: float,
                  bf16_autocast: bool, threads: int | None,
                  eval_prompts: Path | None, num_eval: int, eval_max_tokens: int) -> None:
    """Train an EAGLE drafter for MODEL on its own answers to PROMPTS; write it to OUT."""
    if max_steps is None and time_budget is None:
        raise click.UsageError("give --max-steps or --time-budget")
    budget_s = parse_duration(time_budget) if time_budget is not None else None
    if threads is not None:
        torch.set_num_threads(threads)
    if init_drafter is not None:
        try:
            load_init_drafter(init_drafter, style, layers,
                              load_model_config(resolve_model(model)))
        except (ValueError, FileNotFoundError) as e:
            raise click.BadParameter(str(e), param_hint="--init-drafter") from e
    ids, prompts = read_prompts(prompts_path, max_train_prompts, "--prompts", prompt_column,
                                messages_column)
    evals = (read_prompts(eval_prompts, num_eval, "--eval-prompts", prompt_column,
                          messages_column)[1] if eval_prompts is not None else ())
    train = TrainConfig(num_steps=unroll or num_speculative_tokens, lr=lr,
                        warmup_steps=warmup_steps, max_steps=max_steps,
                        time_budget_s=budget_s,
                        batch_tokens=batch_tokens, autocast_bf16=bf16_autocast,
                        ce_weight=token_loss_weight)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C
    try:
        run_train_drafter(TrainDrafterJob(
            model=model, prompt_ids=ids, prompts=prompts, out_dir=out_dir, train=train,
            num_layers=layers, style=style, num_speculative_tokens=num_speculative_tokens,
            draft_vocab_size=draft_vocab_size, draft_head_size=draft_head_size,
            max_answer_tokens=max_answer_tokens, answer_samples=answer_samples,
            first_sample=first_sample,
            answer_temperature=answer_temperature, data_dtype=data_dtype,
            feature_dtype=feature_dtype,
            init_drafter=init_drafter, resume=resume,
            eval_prompts=evals, eval_max_tokens=eval_max_tokens, prompts_source=prompts_path.name))
    except (ValueError, FileNotFoundError, FileExistsError) as exc:  # the inputs, not the code
        click.echo(f"error: {one_line(exc)}", err=True)
        sys.exit(2)
    except OSError as exc:  # a file of --out that cannot be written or read (a full disk, a
        if exc.filename is None:  # directory where a file goes): named; any other is a bug
            raise
        click.echo(f"error: {exc.filename}: {exc.strerror}", err=True)
        sys.exit(2)
    except TrainingInterrupted as stop:
        click.echo(f"\n{stop}; its checkpoint is saved in {out_dir / 'checkpoint.pt'}: rerun the "
                   "same command with --resume to continue", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; the answers and features made so far are kept in "
                   f"{out_dir / 'data'}: rerun the same command with --resume to continue",
                   err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    train_drafter()

"""One shard through the stages: read -> tokenize -> generate -> detokenize -> write."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import pyarrow as pa

from pipeline.sources import Shard
from pipeline.stages.detokenize import detokenize
from pipeline.stages.generate import EngineLike, generate_rows
from pipeline.stages.read import read_shard_table, unreadable_row_errors
from pipeline.stages.tokenize import PreparedRow, TokenizeOptions, tokenize_rows
from pipeline.stages.write import RowOutput, assemble, write_part
from pipeline.stats import Counts
from runtime.request import Completion


class ShardContext(NamedTuple):
    """What every shard of a job shares."""

    engine: EngineLike
    tokenize: TokenizeOptions
    n: int
    id_column: str
    has_id_column: bool
    output_dir: str
    output_prefix: str = ""  # --output-prefix
    # the optional columns it writes (JobConfig.optional_columns: --logprobs, --top-logprobs,
    # --prompt-logprobs)
    optional_columns: tuple[str, ...] = ()
    include_stop: bool = False  # --include-stop-str-in-output


class ShardHooks(NamedTuple):
    # input rows finished, and the prompt tokens of their samples that did not fail (as
    # Counts.prompt_tokens counts them)
    rows_done: Callable[[int, int], None]
    on_step: Callable[[int], None]  # tokens generated in one engine step; may raise to abandon
    check_stop: Callable[[], None]  # raises to abandon the shard between stages


def run_shard(shard: Shard, ctx: ShardContext, hooks: ShardHooks) -> Counts:
    """Generate and commit one part file; return its counters. Nothing is written if it raises."""
    start = time.monotonic()
    table = read_shard_table(shard)
    row_ids = _row_ids(table, shard, ctx)
    prepared = tokenize_rows(table, ctx.engine.tokenizer, ctx.tokenize)
    if (unreadable := unreadable_row_errors(shard)) is not None:
        prepared = [p if error is None else PreparedRow(None, None, False, error)
                    for p, error in zip(prepared, unreadable, strict=True)]
    hooks.rows_done(sum(p.error is not None for p in prepared), 0)
    hooks.check_stop()
    n = ctx.n
    results: list[Completion | None] = [None] * (len(prepared) * n)
    samples_left = [n] * len(prepared)
    for r in generate_rows(ctx.engine, prepared, row_ids, n, hooks.on_step):
        results[r.row * n + r.sample] = r.completion
        samples_left[r.row] -= 1
        if samples_left[r.row] == 0:
            hooks.rows_done(1, _prompt_tokens(prepared[r.row], results[r.row * n:(r.row + 1) * n]))
    hooks.check_stop()
    outputs = _row_outputs(prepared, results, n, ctx)
    generated_ids = None if ctx.has_id_column else row_ids
    write_part(ctx.output_dir, shard.part_name,
               assemble(table, outputs, n, generated_ids, ctx.id_column, ctx.output_prefix,
                        ctx.optional_columns))
    return _counts(results, outputs, time.monotonic() - start)


def _prompt_tokens(row: PreparedRow, samples: Sequence[Completion | None]) -> int:
    """The row's prompt tokens once for each of its samples that did not fail."""
    ok = sum(c is not None and c.finish_reason != "error" for c in samples)
    return ok * len(row.prompt_token_ids or ())


def _row_ids(table: pa.Table, shard: Shard, ctx: ShardContext) -> list[str]:
    if ctx.has_id_column:
        return [str(v) for v in table.column(ctx.id_column).to_pylist()]
    return [f"{shard.file.id_stem}:{shard.start + i}" for i in range(table.num_rows)]


def _row_outputs(prepared: Sequence[PreparedRow], results: Sequence[Completion | None], n: int,
                 ctx: ShardContext) -> list[RowOutput]:
    done = [c for c in results if c is not None]
    texts = iter(detokenize(done, ctx.engine.tokenizer, ctx.include_stop))
    outputs = []
    for index, completion in enumerate(results):
        row = prepared[index // n]
        if row.error is not None:
            prompt_tokens = None if row.prompt_token_ids is None else len(row.prompt_token_ids)
            outputs.append(RowOutput(None, None, "error", prompt_tokens, 0, 0, 0, False, row.error))
            continue
        if completion is None:
            raise RuntimeError(f"the engine returned no completion for request {index // n}:"
                               f"{index % n}")
        assert row.prompt_token_ids is not None
        text = next(texts)
        if completion.finish_reason == "error":  # the engine refused it (e.g. KV cache too small)
            outputs.append(RowOutput(None, None, "error", len(row.prompt_token_ids), 0, 0, 0,
                                     row.max_tokens_clamped, completion.error or "engine error"))
            continue
        outputs.append(RowOutput(text, list(completion.token_ids),
                                 completion.finish_reason, len(row.prompt_token_ids),
                                 len(completion.token_ids), completion.num_drafted,
                                 completion.num_accepted, row.max_tokens_clamped, None,
                                 None if completion.logprobs is None
                                 else list(completion.logprobs),
                                 None if completion.top_logprobs is None
                                 else list(completion.top_logprobs),
                                 None if completion.prompt_logprobs is None
                                 else [None, *completion.prompt_logprobs]))
    return outputs


def _counts(results: Sequence[Completion | None], outputs: Sequence[RowOutput],
            seconds: float) -> Counts:
    c = Counts(rows=len(outputs), errors=sum(o.finish_reason == "error" for o in outputs),
               wall_seconds=seconds)
    for out, completion in zip(outputs, results, strict=True):
        if completion is None or out.finish_reason == "error":
            continue
        c.prompt_tokens += out.prompt_tokens or 0
        c.completion_tokens += out.completion_tokens
        c.drafted += completion.num_drafted
        c.accepted += completion.num_accepted
        c.draft_steps += completion.num_draft_steps
        c.add_positions(completion.accepted_per_position)
    return c

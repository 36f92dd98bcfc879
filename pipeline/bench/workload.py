"""The benchmark's prompts: read from Parquet, tokenized the way `eaglebatch generate` does."""

from __future__ import annotations

import glob
import os
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import JobError
from pipeline.schema import is_messages_type, is_string
from pipeline.stages.tokenize import TokenizeOptions, tokenize_rows
from runtime.config import SamplingParams
from runtime.request import GenerationRequest


class Workload(NamedTuple):
    """The same requests for every variant: prompt ids and a per-request max_tokens (lowered
    only where the prompt leaves less room in the context)."""

    prompts: list[tuple[int, ...]]
    max_tokens: list[int]
    ignore_eos: bool
    skipped: int  # prompts that could not be tokenized (empty, too long) and were left out
    first_id: int = 0  # the request id of prompts[0] (ids count on from it)

    def request_ids(self) -> list[str]:
        return [str(self.first_id + i) for i in range(len(self.prompts))]

    def requests(self) -> list[GenerationRequest]:
        return [GenerationRequest(rid, ids, SamplingParams(max_tokens=n,
                                                           ignore_eos=self.ignore_eos))
                for rid, ids, n in zip(self.request_ids(), self.prompts, self.max_tokens,
                                       strict=True)]

    def part(self, start: int, stop: int) -> Workload:
        """Prompts start..stop-1, with the request ids they have in the whole workload."""
        return self._replace(prompts=self.prompts[start:stop],
                             max_tokens=self.max_tokens[start:stop],
                             first_id=self.first_id + start)

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]


def read_prompts(path: str, prompt_column: str, limit: int | None,
                 messages_column: str | None = None) -> pa.Table:
    """The first `limit` rows (all when None) of the prompt (or messages) column, read batch by
    batch."""
    column = messages_column or prompt_column
    if not os.path.exists(path):
        glob_note = "; bench reads one Parquet file, not a glob" if glob.has_magic(path) else ""
        raise JobError(f"--prompts {path}: no such file{glob_note}")
    if os.path.isdir(path):
        raise JobError(f"--prompts {path} is a directory; give one Parquet file")
    try:
        source = pq.ParquetFile(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise JobError(f"--prompts {path}: cannot read it as Parquet ({exc})") from None
    option = "--messages-column" if messages_column else "--prompt-column"
    if column not in source.schema_arrow.names:
        raise JobError(f"--prompts {path} has no column {column!r} ({option}; columns: "
                       f"{', '.join(source.schema_arrow.names)})")
    kind = source.schema_arrow.field(column).type
    if messages_column and not is_messages_type(kind):
        raise JobError(f"--prompts {path}: column {column!r} is {kind}, expected "
                       f"list<struct<role: string, content: string>> ({option})")
    if not messages_column and not is_string(kind):
        hint = " (chat messages: --messages-column)" if is_messages_type(kind) else ""
        raise JobError(f"--prompts {path}: column {column!r} is {kind}, expected string "
                       f"({option}){hint}")
    batches = []
    rows = 0
    for batch in source.iter_batches(columns=[column], batch_size=1024):
        batches.append(batch)
        rows += batch.num_rows
        if limit is not None and rows >= limit:
            break
    if rows == 0:
        raise JobError(f"--prompts {path} has no rows")
    table = pa.Table.from_batches(batches, schema=pa.schema([source.schema_arrow.field(column)]))
    return table.slice(0, limit) if limit is not None else table


def build_workload(table: pa.Table, column: str, messages_column: str | None, tokenizer: Any,
                   max_model_len: int, max_tokens: int, chat_template: bool,
                   ignore_eos: bool) -> Workload:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if messages_column is not None and not has_template:
        raise JobError(f"--messages-column {messages_column}: the model's tokenizer has no chat "
                       "template to render messages with")
    options = TokenizeOptions(column, messages_column, chat_template and has_template,
                              max_model_len, SamplingParams(max_tokens=max_tokens))
    prompts, limits = [], []
    for row in tokenize_rows(table, tokenizer, options):
        if row.prompt_token_ids is None or row.params is None:
            continue
        prompts.append(row.prompt_token_ids)
        limits.append(row.params.max_tokens)
    if not prompts:
        raise JobError(f"--prompts: none of the {table.num_rows} prompts in column "
                       f"{messages_column or column!r} could be tokenized (null, empty, "
                       "malformed, or too long for the model's context)")
    return Workload(prompts, limits, ignore_eos, table.num_rows - len(prompts))

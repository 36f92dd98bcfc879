"""Write stage: assemble a shard's output table (input order) and commit it as a part file."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.atomic import write_atomically
from pipeline.schema import output_fields, output_schema, sample_index_field
from runtime.request import TopLogprobs


class RowOutput(NamedTuple):
    """The generated columns of one output row (see pipeline.schema)."""

    completion: str | None
    completion_token_ids: list[int] | None
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int
    num_drafted: int
    num_accepted: int
    max_tokens_clamped: bool
    error: str | None
    completion_logprobs: list[float] | None = None  # written with --logprobs only
    # written with --top-logprobs only: per token, (token id, log-probability) pairs
    completion_top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[float | None] | None = None  # written with --prompt-logprobs only


def assemble(inputs: pa.Table, outputs: Sequence[RowOutput], n: int,
             generated_ids: Sequence[str] | None, id_column: str, prefix: str = "",
             optional: tuple[str, ...] = ()) -> pa.Table:
    """Input columns (each row repeated n times when n > 1) + generated columns (their names
    after `prefix`, --output-prefix).

    outputs[i * n + s] is sample s of input row i.
    """
    if len(outputs) != inputs.num_rows * n:
        raise ValueError(f"{len(outputs)} outputs for {inputs.num_rows} rows x n={n}")
    table = inputs
    if generated_ids is not None:
        table = table.add_column(0, pa.field(id_column, pa.string()),
                                 pa.array(list(generated_ids), pa.string()))
    if n > 1:
        table = table.take(pa.array([row for row in range(inputs.num_rows) for _ in range(n)],
                                    pa.int64()))
        samples = pa.array([s for _ in range(inputs.num_rows) for s in range(n)], pa.int32())
        table = table.append_column(sample_index_field(prefix), samples)
    for field in output_fields(prefix, optional):
        name = field.name[len(prefix):]  # RowOutput's field
        table = table.append_column(field, pa.array([getattr(o, name) for o in outputs],
                                                    field.type))
    schema = output_schema(inputs.schema, n, id_column if generated_ids is not None else None,
                           prefix, optional)
    return table.cast(schema)


def write_part(output_dir: str, part_name: str, table: pa.Table) -> str:
    """Write `table` to output_dir/part_name atomically (temp, fsync, rename); return the path."""
    path = os.path.join(output_dir, part_name)
    write_atomically(path, lambda f: pq.write_table(table, f))
    return path

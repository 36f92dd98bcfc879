"""The output schema, and the checks that an input schema can be turned into it.

Each output row is one input row (or one sample of it when n > 1) with every input column passed
through unchanged, followed by (named after --output-prefix, if given: judge_completion, ...):

    sample_index          int32        only when n > 1: 0 .. n-1
    completion            string       the generated text, cut at the stop string; null on error
    completion_token_ids  list<int32>  the generated token ids as the engine returned them;
                                       null on error
    finish_reason         string       "stop" (EOS or stop string), "length" or "error"
    prompt_tokens         int32        tokens in the (templated) prompt; null when it could not
                                       be tokenized
    completion_tokens     int32        len(completion_token_ids); 0 on error
    num_drafted           int32        draft tokens proposed for this row (0 without a drafter)
    num_accepted          int32        draft tokens accepted
    max_tokens_clamped    bool         true when max_tokens was lowered so that prompt +
                                       completion fit the model's context
    error                 string       why the row could not be generated; null when fine

When the input has no id column, a string column named after --id-column is put first, holding
`<file stem>:<row index>` (for files in Hive partition folders, `<path under INPUT without its
suffix>:<row index>`: pipeline.sources.InputFile.id_stem). Columns of Hive partition folders
follow the input's own, as strings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pipeline.config import JobConfig, JobError

OUTPUT_FIELDS: tuple[pa.Field, ...] = (
    pa.field("completion", pa.string()),
    pa.field("completion_token_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("num_drafted", pa.int32()),
    pa.field("num_accepted", pa.int32()),
    pa.field("max_tokens_clamped", pa.bool_()),
    pa.field("error", pa.string()),
)
SAMPLE_INDEX_FIELD = pa.field("sample_index", pa.int32())
# only with --logprobs: each generated token's log-probability, one per completion_token_ids entry
LOGPROBS_FIELD = pa.field("completion_logprobs", pa.list_(pa.float32()))
# only with --top-logprobs N: for each generated token, the N most likely tokens where it was
# drawn, most likely first
TOP_LOGPROBS_FIELD = pa.field("completion_top_logprobs", pa.list_(pa.list_(pa.struct(
    [("token_id", pa.int32()), ("logprob", pa.float32())]))))
# only with --prompt-logprobs: each prompt token's log-probability given those before it, one
# per prompt token (prompt_tokens of them), the first null
PROMPT_LOGPROBS_FIELD = pa.field("prompt_logprobs", pa.list_(pa.float32()))
# the columns only some jobs write (JobConfig.optional_columns), after the others in this order
OPTIONAL_FIELDS = (LOGPROBS_FIELD, TOP_LOGPROBS_FIELD, PROMPT_LOGPROBS_FIELD)

# Optional input columns that override the job's sampling options row by row.
OVERRIDE_COLUMNS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "stop", "stop_token_ids", "repetition_penalty", "frequency_penalty",
                    "presence_penalty", "allowed_token_ids", "logit_bias", "guided_choice",
                    "guided_regex", "guided_json")
_NUMBER_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty")


def output_fields(prefix: str = "", optional: tuple[str, ...] = ()) -> tuple[pa.Field, ...]:
    """The columns a job adds after the input's, named with --output-prefix before them, and
    last those of OPTIONAL_FIELDS named in `optional` (JobConfig.optional_columns)."""
    unknown = set(optional) - {f.name for f in OPTIONAL_FIELDS}
    if unknown:
        raise ValueError(f"no optional output column {sorted(unknown)[0]!r}")
    return tuple(f.with_name(prefix + f.name) for f in OUTPUT_FIELDS + tuple(
        f for f in OPTIONAL_FIELDS if f.name in optional))


def sample_index_field(prefix: str = "") -> pa.Field:
    return SAMPLE_INDEX_FIELD.with_name(prefix + SAMPLE_INDEX_FIELD.name)


def output_schema(input_schema: pa.Schema, n: int, generated_id_column: str | None,
                  prefix: str = "", optional: tuple[str, ...] = ()) -> pa.Schema:
    """The schema of every part file written for inputs of `input_schema`. The input columns
    keep their types but may hold nulls (a row group that could not be read gives them null;
    input files may differ in whether a column is nullable)."""
    fields = list(_nullable(input_schema))
    if generated_id_column is not None:
        fields.insert(0, pa.field(generated_id_column, pa.string()))
    if n > 1:
        fields.append(sample_index_field(prefix))
    return pa.schema(fields + list(output_fields(prefix, optional)),
                     metadata=input_schema.metadata)


def python_values(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """The column's values as Python objects. Parquet does not check that strings are UTF-8: a
    value that is not comes back as the UnicodeDecodeError that decoding it raised, so the
    caller can name its row."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        values: list[Any] = []
        for i in range(len(column)):
            try:
                values.append(column[i].as_py())
            except UnicodeDecodeError as exc:
                values.append(exc)
        return values


def is_string(t: pa.DataType) -> bool:
    """Any Arrow string type, dictionary-encoded strings (pandas' category dtype) included."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_string_view(t))


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t))


def is_messages_type(t: pa.DataType) -> bool:
    """list<struct<role: string, content: string, ...>> (extra struct fields are allowed)."""
    if not _is_list(t) or not pa.types.is_struct(t.value_type):
        return False
    struct = t.value_type
    names = [struct.field(i).name for i in range(struct.num_fields)]
    return all(name in names and is_string(struct.field(name).type)
               for name in ("role", "content"))


def _override_type_ok(name: str, t: pa.DataType) -> bool:
    if pa.types.is_null(t):  # every value null (pandas writes an all-None column so): no override
        return True
    if name in ("max_tokens", "min_tokens", "top_k", "seed"):
        return bool(pa.types.is_integer(t))
    if name in _NUMBER_COLUMNS:
        return bool(pa.types.is_floating(t) or pa.types.is_integer(t))
    if name in ("guided_regex", "guided_json"):
        return is_string(t)
    if name == "logit_bias":  # map<integer, number>
        return bool(pa.types.is_map(t) and pa.types.is_integer(t.key_type)
                    and (pa.types.is_floating(t.item_type) or pa.types.is_integer(t.item_type)))
    # stop, stop_token_ids, allowed_token_ids, guided_choice: list<null> is what pyarrow infers
    # for lists that are all empty (or all null)
    of = is_string if name in ("stop", "guided_choice") else pa.types.is_integer
    return _is_list(t) and (bool(of(t.value_type)) or pa.types.is_null(t.value_type))


_OVERRIDE_TYPE_NAMES = {"max_tokens": "an integer", "min_tokens": "an integer",
                        "top_k": "an integer", "seed": "an integer",
                        "stop": "list<string>", "stop_token_ids": "list<integer>",
                        "allowed_token_ids": "list<integer>", "guided_choice": "list<string>",
                        "guided_regex": "a string", "guided_json": "a string (a JSON schema)",
                        "logit_bias": "map<integer, number> (token id -> bias)",
                        **{name: "a number" for name in _NUMBER_COLUMNS}}


def schema_difference(schema: pa.Schema, first: pa.Schema) -> str | None:
    """How `schema` differs from `first` in columns and types (metadata, nullability and the
    columns' order aside: a file is read in the first file's column order), or None."""
    if _nullable(schema).equals(_nullable(first), check_metadata=False):
        return None
    if (twice := repeated_name(schema.names)) is not None:
        return f"two columns named {twice!r}"
    missing = [n for n in first.names if n not in schema.names]
    extra = [n for n in schema.names if n not in first.names]
    if missing or extra:
        return ", ".join([f"no column {n!r}" for n in missing] + [f"an extra column {n!r}"
                                                                  for n in extra])
    for name in first.names:
        mine, theirs = schema.field(name), first.field(name)
        if mine.type != theirs.type:
            return f"column {name!r} is {mine.type}, not {theirs.type}"
    return None  # the same columns in another order


def _nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([field.with_nullable(True) for field in schema])


def check_input_schema(schema: pa.Schema, path: str, config: JobConfig) -> bool:
    """Refuse an input schema we cannot generate from; return whether it has the id column."""
    names = schema.names
    if (twice := repeated_name(names)) is not None:
        raise JobError(f"{path}: the input has two columns named {twice!r}; column names must "
                       f"be unique")
    if config.messages_column is not None:
        _check_column(schema, path, config.messages_column, is_messages_type,
                      "list<struct<role: string, content: string>>", "--messages-column")
    else:
        _check_column(schema, path, config.prompt_column, is_string, "string", "--prompt-column")
    has_id = config.id_column in names
    if has_id:
        id_type = schema.field(config.id_column).type
        if not (is_string(id_type) or pa.types.is_integer(id_type)
                or pa.types.is_null(id_type)):  # all null: the scan names the first row
            raise JobError(f"{path}: id column {config.id_column!r} is {id_type}; ids must be "
                           f"strings or integers (see --id-column)")
    for name in OVERRIDE_COLUMNS:
        if name in names and not _override_type_ok(name, schema.field(name).type):
            raise JobError(f"{path}: column {name!r} overrides the {name} option per row and must "
                           f"be {_OVERRIDE_TYPE_NAMES[name]}, but it is {schema.field(name).type}")
    prefix = config.output_prefix
    reserved = ([sample_index_field(prefix).name] if config.n > 1 else []) + [
        f.name for f in output_fields(prefix, config.optional_columns())]
    clashes = [name for name in names if name in reserved]
    if clashes:
        way = (f"choose another --output-prefix ({prefix!r} makes {clashes[0]!r} too)" if prefix
               else "rename it, or give the output columns a prefix with --output-prefix")
        raise JobError(f"{path}: input column {clashes[0]!r} has the name of an output column; "
                       f"{way} (output columns: {', '.join(reserved)})")
    if not has_id and config.id_column in reserved:
        raise JobError(f"--id-column {config.id_column!r}: {path} has no such column, so ids "
                       f"would be written to a new one, but that is the name of an output "
                       f"column; choose another (output columns: {', '.join(reserved)})")
    return has_id


def repeated_name(names: list[str]) -> str | None:
    """The first name that occurs twice in `names`, or None."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _check_column(schema: pa.Schema, path: str, column: str,
                  type_ok: Callable[[pa.DataType], bool], want: str, option: str) -> None:
    if column not in schema.names:
        chats = [f.name for f in schema if is_messages_type(f.type)]
        hint = (f", or give the chat column {chats[0]!r} with --messages-column"
                if chats and option == "--prompt-column" else "")
        raise JobError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}); "
                       f"choose the column with {option}{hint}")
    t = schema.field(column).type
    if not (type_ok(t) or pa.types.is_null(t)):  # all null: every row gets its error
        raise JobError(f"{path}: column {column!r} is {t}, expected {want} ({option})")

"""The "Error rows by message" section of a job's report.md: the most common `error` messages of
its error rows, read from the part files, those that differ only in their numbers counted
together."""

from __future__ import annotations

import collections
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.bench import markdown as md
from pipeline.discover import part_name
from pipeline.schema import OPTIONAL_FIELDS
from pipeline.stats import Counts


def error_reasons(directory: str, shards: dict[int, Counts]) -> str:
    """The most common `error` messages of the committed shards' error rows, read from their
    part files (only where some shard has error rows). The job's error column is a part file's
    last but the optional ones (--logprobs, ...): `error`, or P + `error` with --output-prefix P
    (an input column of that name, from an earlier job, comes before it)."""
    with_errors = [s for s, c in shards.items() if c.errors]
    if not with_errors:
        return ""
    reasons: collections.Counter[str] = collections.Counter()  # by message_pattern
    first: dict[str, str] = {}  # pattern -> its first message
    numbers: dict[str, list[str | None]] = {}  # pattern -> its numbers, None where they differ
    unread = []
    for shard in with_errors:
        path = os.path.join(directory, part_name(shard))
        try:
            names = pq.read_schema(path).names
            while len(names) > 1 and names[-1].endswith(_OPTIONAL_COLUMNS):
                names = names[:-1]
            if not names[-1].endswith("error"):
                raise KeyError(names[-1])  # not a part file of a job
            column = pq.read_table(path, columns=[names[-1]]).column(0)
        except (OSError, KeyError, pa.ArrowInvalid):
            unread.append(shard)
            continue
        for error in column.to_pylist():
            if error is not None:
                pattern = message_pattern(error)
                reasons[pattern] += 1
                found = _NUMBER.findall(error)
                first.setdefault(pattern, error)
                known = numbers.setdefault(pattern, list(found))
                for i, (was, now) in enumerate(zip(known, found, strict=True)):  # same count
                    if was != now:
                        known[i] = None
    parts = ["## Error rows by message"]
    if reasons:
        top = reasons.most_common(_MAX_REASONS)
        # N only for the numbers that differ between a pattern's messages
        shown = [(_numbers_that_differ(first[p], numbers[p]), n) for p, n in top]
        parts.append(md.table(["error rows", "error"],
                              [[f"{n:,}", "`" + md.cell(e) + "`"] for e, n in shown]))
        if any(None in numbers[p] for p, _ in top):
            parts.append("(N: a number; messages that differ only in their numbers are counted "
                         "together)")
        if len(reasons) > len(top):
            parts.append(f"({len(reasons) - len(top)} other messages not listed)")
    if unread:
        parts.append(f"The part files of shard(s) {', '.join(map(str, unread[:20]))} could not "
                     "be read for their messages.")
    return "\n\n".join(parts)


_MAX_REASONS = 10
_OPTIONAL_COLUMNS = tuple(f.name for f in OPTIONAL_FIELDS)  # after the error column, in order
# a number, with its minus sign where one stands before it as a sign ('got -0.1', not the dash
# of 'rows 10-19') and its exponent ('3e-05')
_NUMBER = re.compile(r"(?:(?<![\w.])-)?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def message_pattern(error: str) -> str:
    """An error message with its numbers replaced by a NUL, so that the rows' messages that
    differ only in them (a prompt's token count, a row index) are counted together. Example:
    'prompt has 91 tokens' -> 'prompt has \\0 tokens'. (A letter N would be taken for a number
    that a message writes as N: 'role (N)' and 'role (5)' were one pattern of 1 and 2 numbers.)"""
    return _NUMBER.sub("\0", error)


def _numbers_that_differ(message: str, numbers: list[str | None]) -> str:
    """`message` with N for each number where its pattern's messages differ (numbers: None
    there): 'prompt has N tokens; the model's context is 64' for prompts of many lengths."""
    found = iter(numbers)
    return _NUMBER.sub(lambda m: next(found) or "N", message)

"""Click parameter callbacks shared by the commands."""

from __future__ import annotations

import json
import math
import os
import re

import click

from runtime.config import parse_memory_size


def memory_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """'2GiB' -> bytes, as a Click callback; None stays None."""
    if value is None:
        return None
    try:
        return parse_memory_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def not_blank(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A model or drafter given as an empty or blank string is refused here, as such (a path
    '' would otherwise be read as the current directory, or named as a model called '')."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"{value!r} is blank: give a name or a path")
    return value


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """NaN passes Click's FloatRange (every comparison with it is false), and inf passes a range
    open above: both are refused here."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def stop_strings(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
                 ) -> tuple[str, ...]:
    """--stop: an empty string is refused (it would end every completion at once)."""
    if any(not s for s in value):
        raise click.BadParameter("an empty stop string would end every completion at its first "
                                 "token")
    return value


def token_ids(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """'5, 17,5' -> (5, 17): sorted and once each (the same set resumes a job alike); only
    ASCII digits (Python's int() also reads other scripts' digits)."""
    if not value.strip():
        return ()
    parts = value.split(",")
    bad = next((p for p in parts if not re.fullmatch(r"\s*[0-9]+\s*", p)), None)
    if bad is not None:
        said = "an empty entry" if not bad.strip() else repr(bad.strip())
        raise click.BadParameter(f"{value!r} is not a comma-separated list of token ids "
                                 f"(digits 0-9): {said}")
    return tuple(sorted({int(p) for p in parts}))


def logit_bias(ctx: click.Context, param: click.Parameter, value: str
               ) -> tuple[tuple[int, float], ...]:
    """'17:2.5, 90:-100' or the JSON object '{"17": 2.5, "90": -100}' (OpenAI's form) -> the
    (token id, bias) pairs sorted by id; an id given twice, or a bias that is not a finite
    number, is refused (its range is checked with the other sampling options)."""
    text = value.strip()
    if not text:
        return ()
    if text.startswith("{"):
        try:
            pairs = json.loads(text, object_pairs_hook=list)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"{value!r} is not a JSON object: {exc}") from None
    else:
        pairs = [tuple(p.split(":", 1)) if ":" in p else (p, "") for p in text.split(",")]
    out: dict[int, float] = {}
    for key, bias in pairs:
        token = str(key).strip()
        if not re.fullmatch(r"[0-9]+", token):
            raise click.BadParameter(f"{value!r}: {token!r} is not a token id (digits 0-9); "
                                     "write ID:BIAS pairs, e.g. 17:2.5,90:-100")
        try:
            if isinstance(bias, bool):
                raise TypeError
            number = float(bias.strip()) if isinstance(bias, str) else float(bias)
        except (TypeError, ValueError):
            raise click.BadParameter(f"{value!r}: the bias of token {token} ({bias!r}) is not "
                                     "a number") from None
        if not math.isfinite(number):
            raise click.BadParameter(f"{value!r}: the bias of token {token} ({bias!r}) is not "
                                     "a finite number")
        if int(token) in out:
            raise click.BadParameter(f"{value!r}: token {token} is given more than one bias")
        out[int(token)] = number
    return tuple(sorted(out.items()))


def json_schema(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--guided-json: a schema's text, or the path of a file holding it (read here), as the
    schema's JSON written compactly (the same schema resumes a job alike however spaced)."""
    if value is None:
        return None
    text = value
    if not value.lstrip().startswith("{"):  # a file's path
        if not os.path.isfile(value):
            raise click.BadParameter(f"{value!r} is neither a JSON schema's text (an object, "
                                     "'{...}') nor a file")
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {value}: {exc}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        where = "" if text is value else f" (read from {value})"
        raise click.BadParameter(f"not a JSON schema{where}: {exc}") from None
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)

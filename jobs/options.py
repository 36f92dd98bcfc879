"""Click parameter callbacks shared by the commands."""

from __future__ import annotations

import math

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

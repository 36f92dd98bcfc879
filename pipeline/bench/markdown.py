"""Small Markdown helpers for report.md: tables and number formats."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table; numeric-looking columns are right-aligned."""
    aligns = ["---:" if rows and all(_numeric(r[i]) for r in rows) else "---"
              for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(aligns) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _numeric(cell: str) -> bool:
    """'1,234.5', '12%', '±3.1%', '1.46x', '1.46x (1.31-1.52)' (a ratio and its range), '–',
    a blank cell (a short row of a table), and numbers side by side ('74.0% 54.0% 4.0%': the
    acceptance at each draft position)."""
    if cell in ("–", "") or _number(cell.split(" (")[0].replace(" ", "")):
        return True
    return all(_number(part) for part in cell.split(" ") if part)


def _number(text: str) -> bool:
    stripped = text.rstrip("x%").replace(",", "").replace("±", "")
    return stripped.replace(".", "", 1).lstrip("-").isdigit()


def cell(text: str, limit: int = 160) -> str:
    """Text for a table cell or a line of code: on one line, without the characters that would
    end either, cut to `limit` characters."""
    line = " ".join(text.split()).replace("`", "'").replace("|", "\\|")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:,.0f}"


def mib(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / (1 << 20):,.0f}"


def size(nbytes: int) -> str:
    """A memory size as given to --kv-cache-memory: '200 KiB', '16 MiB', '1.5 GiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):,.4g} {unit}"
    return f"{nbytes} bytes"


def plural(count: int, noun: str) -> str:
    """'1 prompt', '16 prompts'."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")

"""What the input tests share: the paths discover_inputs finds, a job's config of an INPUT, and
rows of ids and prompts."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import JobConfig
from pipeline.discover import discover_inputs


def resolve_input(spec: str, output_dir: str | None = None) -> list[str]:
    """The paths discover_inputs finds."""
    return [found.path for found in discover_inputs(spec, output_dir)]


def _config(input_path: Path | str, **kw: object) -> JobConfig:
    return JobConfig(input=str(input_path), output_dir="unused", **kw)  # type: ignore[arg-type]


def _prompts(n: int, start: int = 0) -> dict[str, list]:
    return {"id": [f"r{i}" for i in range(start, start + n)],
            "prompt": [f"prompt {i}" for i in range(start, start + n)]}

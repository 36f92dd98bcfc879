"""Build ``examples/prompts.parquet`` from the hand-written ``examples/prompts.jsonl``.

The JSONL file is the source of truth: one JSON object per line with the keys
``id`` (``p0001``, ``p0002``, ...), ``category`` and ``prompt``. The prompts were
written by hand for this project (they are not taken from any public data set):
factual questions, explanations (science, history, economics, programming),
short writing and summarisation tasks, code tasks (some with a pasted snippet),
math word problems, advice, comparisons, lists, reasoning and editing tasks.

The Parquet output has exactly three string columns, in this order:
``id``, ``category``, ``prompt``. Rows keep the JSONL order, so the output is
deterministic for a given pyarrow version.

Usage (from the repository root)::

    python examples/make_prompts.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
SRC = HERE / "prompts.jsonl"
DST = HERE / "prompts.parquet"

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("category", pa.string()),
        pa.field("prompt", pa.string()),
    ]
)
ID_RE = re.compile(r"^p\d{4}$")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def load_rows(path: Path = SRC) -> list[dict[str, str]]:
    """Read and validate the JSONL prompt file."""
    rows: list[dict[str, str]] = []
    seen_ids: set[str] = set()
    seen_text: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if set(obj) != {"id", "category", "prompt"}:
                raise ValueError(f"{path.name}:{lineno}: unexpected keys {sorted(obj)}")
            for key in ("id", "category", "prompt"):
                if not isinstance(obj[key], str) or not obj[key].strip():
                    raise ValueError(f"{path.name}:{lineno}: empty or non-string {key!r}")
            if not ID_RE.match(obj["id"]):
                raise ValueError(f"{path.name}:{lineno}: bad id {obj['id']!r}")
            if obj["id"] in seen_ids:
                raise ValueError(f"{path.name}:{lineno}: duplicate id {obj['id']!r}")
            norm = _norm(obj["prompt"])
            if norm in seen_text:
                raise ValueError(f"{path.name}:{lineno}: duplicate prompt text")
            seen_ids.add(obj["id"])
            seen_text.add(norm)
            rows.append({k: obj[k] for k in ("id", "category", "prompt")})
    return rows


def to_table(rows: list[dict[str, str]]) -> pa.Table:
    return pa.Table.from_pydict(
        {name: [r[name] for r in rows] for name in SCHEMA.names}, schema=SCHEMA
    )


def main() -> int:
    rows = load_rows(SRC)
    if len(rows) < 240:
        raise SystemExit(f"expected at least 240 prompts, found {len(rows)}")
    pq.write_table(to_table(rows), DST, compression="zstd")
    cats: dict[str, int] = {}
    for r in rows:
        cats[r["category"]] = cats.get(r["category"], 0) + 1
    print(f"wrote {len(rows)} prompts to {DST.relative_to(HERE.parent)}")
    for cat, n in sorted(cats.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {cat:<14} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

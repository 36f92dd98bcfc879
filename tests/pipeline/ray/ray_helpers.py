"""Helpers for the Ray runner tests: engine factories that run inside the Ray workers (shipped by
value, so the workers need not import this file), inputs, and the check that no Ray process is left.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipeline.config import JobConfig, RayConfig
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from tests.pipeline.helpers import write_parquet

PROMPTS_A: list[str | None] = ["Paris is the capital of", "The quick brown fox", None,
                               "To bake bread, mix", "The sky is blue because"]
PROMPTS_B: list[str | None] = ["Berlin is", "Once upon a time", "Numbers: 0 1 2"]
IDS = [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(3)]
NUM_SHARDS = 5  # shard_rows=2: a0-a1, a2-a3, a4, b0-b1, b2


def write_inputs(directory: Path) -> Path:
    write_parquet(directory / "a.parquet", {"id": IDS[:5], "prompt": PROMPTS_A})
    write_parquet(directory / "b.parquet", {"id": IDS[5:], "prompt": PROMPTS_B})
    return directory


def job_config(inputs: Path, out: Path, model_dir: Path, workers: int | None = 2,
               **kw: Any) -> JobConfig:
    """The job of tests/pipeline/job_cases.py; on Ray when workers is not None."""
    engine = EngineConfig(model=str(model_dir), kv_cache_memory=16 << 20)
    ray = None if workers is None else RayConfig(num_workers=workers)
    return JobConfig(input=str(inputs), output_dir=str(out), engine=engine, shard_rows=2,
                     max_tokens=6, ray=ray, **kw)


def parts(out: Path) -> dict[str, Any]:
    """Every part file's table, by name."""
    return {n: pq.read_table(out / n) for n in sorted(os.listdir(out)) if n.startswith("part-")}


def stats_without_timing(out: Path) -> list[dict[str, Any]]:
    table = pq.read_table(out / "stats.parquet")
    return table.drop(["wall_seconds", "output_tokens_per_s", "committed_at"]).to_pylist()


class LoggedEngines:
    """Engine factory for the workers: the real engine, and one line "<pid>" appended to `log`
    per engine built, so a test can count engine loads per worker process."""

    def __init__(self, log: Path) -> None:
        self.log = str(log)

    def __call__(self, config: EngineConfig) -> Any:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return Engine(config)

    def pids(self) -> list[int]:
        with open(self.log) as f:
            return [int(line) for line in f]


class KillOnce(LoggedEngines):
    """Like LoggedEngines, but the first worker to generate `prompt` SIGKILLs itself mid-shard
    (a marker file makes it happen once across all workers)."""

    def __init__(self, log: Path, marker: Path, prompt: str) -> None:
        super().__init__(log)
        self.marker, self.prompt = str(marker), prompt

    def __call__(self, config: EngineConfig) -> Any:
        return _KillingEngine(super().__call__(config), self.marker, self.prompt)


class SigintDriverAt(LoggedEngines):
    """Like LoggedEngines, but a worker generating `prompt` sends SIGINT to the driver (once)."""

    def __init__(self, log: Path, marker: Path, prompt: str) -> None:
        super().__init__(log)
        self.marker, self.prompt, self.driver = str(marker), prompt, os.getpid()

    def __call__(self, config: EngineConfig) -> Any:
        return _KillingEngine(super().__call__(config), self.marker, self.prompt,
                              (self.driver, signal.SIGINT))


class _KillingEngine:
    def __init__(self, engine: Engine, marker: str, prompt: str,
                 target: tuple[int, int] | None = None) -> None:
        self.engine, self.marker, self.prompt = engine, marker, prompt
        self.target = target or (os.getpid(), signal.SIGKILL)
        self.tokenizer, self.eos_token_ids = engine.tokenizer, engine.eos_token_ids
        self.max_model_len, self.model_name = engine.max_model_len, engine.model_name
        self.unapplied_generation_config = engine.unapplied_generation_config
        self.model_context = engine.model_context
        self.vocab_size = engine.vocab_size

    def generate(self, requests: Iterable[GenerationRequest],
                 on_step: Callable[[int], None] | None = None) -> Iterator[Completion]:
        batch = list(requests)
        texts = [self.tokenizer.decode(list(r.prompt_token_ids)) for r in batch]
        if any(self.prompt in t for t in texts) and _first(self.marker):
            os.kill(*self.target)
        yield from self.engine.generate(batch, on_step)


def _first(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def ray_processes() -> set[int]:
    """Pids of Ray's processes on this machine (servers named after a session; workers)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith("ray::") or "/ray/session_" in cmdline or "-packages/ray/" in cmdline:
            found.add(int(entry))
    return found


def wait_until_gone(pids: Iterable[int], timeout_s: float = 30.0) -> set[int]:
    """The pids still alive after waiting up to timeout_s for them to exit."""
    left = set(pids)
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        left = {p for p in left if _alive(p)}
        if left:
            time.sleep(0.2)
    return left


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # zombies have exited
    except OSError:
        return False

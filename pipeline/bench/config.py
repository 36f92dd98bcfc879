"""The frozen configuration of one `eaglebatch bench` and one `eaglebatch report`.

Every option of the two commands lands in exactly one field here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.bench import markdown as md
from pipeline.config import JobError, check_messages_template
from runtime.config import DEFAULT_MODEL

BASELINES = ("transformers", "none")
RANDOM_PREFIX = "random:"
# random checkpoints (random:<preset>, --drafter random) live in a scratch directory of --out
SCRATCH_PREFIX = ".bench-models-"


def scratch_leftovers(directory: Path) -> list[tuple[Path, int]]:
    """The scratch directories that benches killed outright (out of memory, SIGKILL) left in
    `directory`, with their bytes: random weights, up to tens of GB."""
    found = []
    for stale in sorted(directory.glob(SCRATCH_PREFIX + "*")):
        if stale.is_dir():
            found.append((stale, sum(f.stat().st_size for f in stale.rglob("*") if f.is_file())))
    return found


def scratch_contents(size: int) -> str:
    """What a scratch directory of scratch_leftovers holds, for a message: '513 MiB of random
    weights', or 'empty' (a bench of real weights makes one too)."""
    return f"{md.size(size)} of random weights" if size else "empty"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: every engine variant (k = 0 means no drafter) and the baseline at every
    batch size, on the same prompts, greedy.

    drafter: "auto" (the shipped drafter of the model, a random one for random:<preset>),
    "none", "random" (random weights, measures drafting cost only) or a checkpoint directory.
    kv_cache_memory: bytes per engine; None sizes each engine's cache to hold its whole batch.
    ignore_eos: every request generates exactly max_tokens (always on for random models).
    """

    prompts: str
    out: str
    model: str = DEFAULT_MODEL
    drafter: str = "auto"
    prompt_column: str = "prompt"
    messages_column: str | None = None  # a list<struct<role, content>> column instead
    num_prompts: int | None = None
    chat_template: bool = True
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    ks: tuple[int, ...] = (0, 1, 2, 3, 5)
    draft_confidence: float = 0.0  # EngineConfig.draft_confidence of the k > 0 variants
    draft_int8: bool = False  # EngineConfig.draft_int8 of the k > 0 variants
    draft_max_batch: int | None = None  # EngineConfig.draft_max_batch of the k > 0 variants
    q4_panels: bool = False  # EngineConfig.q4_panels of every engine variant
    draft_ngram: bool = False  # EngineConfig.draft_ngram of the k > 0 variants
    draft_ngram_tokens: int = 0  # EngineConfig.draft_ngram_tokens of the k > 0 variants
    attention_backend: str = "auto"
    cuda_graphs: bool = False  # EngineConfig.cuda_graphs of every engine variant
    # EngineConfig.enable_prefix_caching of every engine variant, the cache emptied before each
    # run (so no run reuses an earlier run's prompts)
    prefix_caching: bool = True
    max_tokens: int = 128
    baseline: str = "transformers"
    repeats: int = 3
    ignore_eos: bool = False
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory: int | None = None
    max_num_batched_tokens: int = 2048
    threads: int | None = None  # torch CPU threads; None: torch's default
    ceiling: bool = False  # also run every k > 0 with perfect drafts (the k = 0 run's tokens)
    overwrite: bool = False  # replace an earlier bench's bench.parquet and report in `out`

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise JobError(f"--batch-sizes must be integers >= 1, got "
                           f"{_listed(self.batch_sizes)!r}")
        if not self.ks or min(self.ks) < 0:
            raise JobError(f"--k must be integers >= 0 (0 = no drafter), got {_listed(self.ks)!r}")
        for option, values in (("--batch-sizes", self.batch_sizes), ("--k", self.ks)):
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise JobError(f"{option} repeats {_listed(repeated)} in {_listed(values)!r}")
        if self.baseline not in BASELINES:
            raise JobError(f"--baseline must be one of {', '.join(BASELINES)}")
        if self.repeats < 1 or self.max_tokens < 1:
            raise JobError("--repeats and --max-tokens must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise JobError(f"--threads must be >= 1, got {self.threads}")
        if self.draft_max_batch is not None and self.draft_max_batch < 1:
            raise JobError(f"--draft-max-batch must be >= 1 (or 0: any batch), "
                           f"got {self.draft_max_batch}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise JobError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        check_messages_template(self.messages_column, self.chat_template)  # as generate
        if self.ceiling and (0 not in self.ks or not self.speculative_ks):
            raise JobError("--ceiling needs k = 0 (its outputs are the perfect drafts) and a "
                           f"k > 0 in --k, got --k {_listed(self.ks)}")

    @property
    def random_preset(self) -> str | None:
        """'llama-3-8b' for --model random:llama-3-8b, else None."""
        return self.model[len(RANDOM_PREFIX):] if self.model.startswith(RANDOM_PREFIX) else None

    @property
    def speculative_ks(self) -> tuple[int, ...]:
        return tuple(k for k in self.ks if k > 0)


@dataclass(frozen=True)
class ReportConfig:
    """`eaglebatch report DIR`: DIR holds a job's stats.parquet + manifest.json, or a bench's
    bench.parquet; report.md and the PNGs go to `out` (default: DIR itself)."""

    directory: str
    out: str | None = None

    @property
    def out_dir(self) -> str:
        return self.out if self.out is not None else self.directory


def _listed(values: tuple[int, ...] | list[int]) -> str:
    return ",".join(map(str, values))


def parse_int_list(text: str, minimum: int = 0) -> tuple[int, ...]:
    """'1,4, 16' -> (1, 4, 16); every entry an integer >= minimum, none empty or repeated."""
    parts = [part.strip() for part in text.split(",")]
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        raise ValueError(f"expected comma-separated integers >= {minimum}, got {text!r}") from None
    if any(v < minimum for v in values):
        raise ValueError(f"expected integers >= {minimum}, got {text!r}")
    if repeated := sorted({v for v in values if values.count(v) > 1}):
        raise ValueError(f"repeats {_listed(repeated)} in {text!r}")
    return values

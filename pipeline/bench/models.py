"""Which checkpoints a bench runs: the target model and, when some k > 0, the drafter."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from pipeline.bench.config import BenchConfig
from pipeline.bench.presets import make_random_checkpoint, make_random_drafter, preset_names
from pipeline.config import JobError
from runtime.loader import default_drafter, resolve_model


class BenchModels(NamedTuple):
    model_dir: Path
    drafter: Path | None  # None when no k > 0 was asked for
    drafter_label: str  # how the report names the drafter
    random: bool  # random weights: outputs and acceptance are meaningless
    random_drafter: bool = False  # made here with random weights: its confidence means nothing


def resolve_models(config: BenchConfig, scratch: Path, dtype: torch.dtype) -> BenchModels:
    """Random checkpoints (random:<preset>, --drafter random) are written under scratch."""
    preset = config.random_preset
    if preset is not None:
        if preset not in preset_names():
            raise JobError(f"--model {config.model}: unknown preset; presets: "
                           f"{', '.join('random:' + n for n in preset_names())}")
        model_dir = make_random_checkpoint(preset, scratch / "model", dtype)
    else:
        try:
            model_dir = resolve_model(config.model)
        except (OSError, ValueError, RuntimeError) as exc:
            raise JobError(f"cannot load --model {config.model}: {exc}") from None
    if not config.speculative_ks:
        return BenchModels(model_dir, None, "none", preset is not None)
    drafter, label = _drafter(config, model_dir, scratch, dtype)
    return BenchModels(model_dir, drafter, label, preset is not None,
                       random_drafter=drafter.is_relative_to(scratch))


def _drafter(config: BenchConfig, model_dir: Path, scratch: Path,
             dtype: torch.dtype) -> tuple[Path, str]:
    option = config.drafter
    if option == "random" or (option == "auto" and config.random_preset is not None):
        return (make_random_drafter(model_dir, scratch / "drafter", dtype),
                "random weights (1-layer EAGLE-1)")
    if option == "auto":
        shipped = default_drafter(config.model)
        if shipped is None:
            raise JobError(f"--k {','.join(map(str, config.speculative_ks))} needs a drafter, "
                           f"and none ships for {config.model}; pass --drafter PATH, "
                           "--drafter random, or --k 0")
        return shipped, f"shipped ({shipped.name})"
    if option == "none":
        raise JobError("--drafter none allows only --k 0")
    path = Path(option)
    if not (path / "config.json").is_file():
        raise JobError(f"--drafter {option}: not an EAGLE checkpoint directory (no config.json)")
    return path, option

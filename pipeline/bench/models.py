"""Which checkpoints a bench runs: the target model and, when some k > 0, the drafter."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoConfig, PretrainedConfig

from pipeline.bench.config import BenchConfig
from pipeline.bench.presets import (
    make_random_checkpoint,
    make_random_drafter,
    preset_config,
    weight_bytes,
)
from pipeline.config import JobError
from runtime.loader import default_drafter, resolve_model
from runtime.speculative.loader import drafter_num_layers


class BenchModels(NamedTuple):
    model_dir: Path
    drafter: Path | None  # None when no k > 0 was asked for
    drafter_label: str  # how the report names the drafter
    random: bool  # random weights: outputs and acceptance are meaningless
    random_drafter: bool = False  # made here with random weights: its confidence means nothing


def resolve_models(config: BenchConfig, scratch: Path, dtype: torch.dtype,
                   device: torch.device) -> BenchModels:
    """Random checkpoints (random:<preset>, --drafter random) are written under scratch, once
    the weights are known to fit in memory."""
    preset = config.random_preset
    if preset is not None:
        try:
            shape = preset_config(preset)
        except ValueError as exc:
            raise JobError(f"--model {config.model}: {exc}") from None
        check_memory(config, shape, dtype, device)
        model_dir = make_random_checkpoint(preset, scratch / "model", dtype)
    else:
        try:
            model_dir = resolve_model(config.model)
            model = AutoConfig.from_pretrained(model_dir)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise JobError(f"cannot load --model {config.model}: {exc}") from None
        check_memory(config, model, dtype, device)
    if not config.speculative_ks:
        return BenchModels(model_dir, None, "none", preset is not None)
    drafter, label = _drafter(config, model_dir, scratch, dtype)
    return BenchModels(model_dir, drafter, label, preset is not None,
                       random_drafter=drafter.is_relative_to(scratch))


# On the CPU the engine keeps one copy of each decoder Linear (its packed panels: the weight
# itself is released), a tied head's weight (the embedding) stays beside its packed copy, and a
# float32 head also gets int8 and bfloat16 copies for the exact greedy head: 1.75 head sizes
# more (1.0 in 16 bits; counted for untied heads too, which let go of their weight: a margin).
# Plus 10% for what the allocator keeps. Peak resident memory of the engine's build measured
# against the formula: random Llama-3.2-1B 5.7 / 7.0 GiB (float32), 3.0 / 3.1 GiB (bfloat16);
# a whole bench of random Llama-3-8B in bfloat16 (--baseline none) 17.4 / 17.5.
_CPU_HEAD_EXTRA = {torch.float32: 1.75}
_CPU_SLACK = 1.1


def engine_bytes(model: PretrainedConfig, weights: int, dtype: torch.dtype,
                 device: torch.device) -> int:
    """Memory one set of engine weights takes on `device` (the bench's variants share it)."""
    if device.type != "cpu":
        return weights
    head = int(getattr(model, "vocab_size", 0)) * int(getattr(model, "hidden_size", 0)) \
        * dtype.itemsize
    return int((weights + _CPU_HEAD_EXTRA.get(dtype, 1.0) * head) * _CPU_SLACK)


def check_memory(config: BenchConfig, model: PretrainedConfig, dtype: torch.dtype,
                 device: torch.device, available: int | None = None) -> None:
    """Refuses, before anything is loaded or written, a bench whose weights alone do not fit in
    the device's available memory (rather than the process being killed halfway). All engine
    variants share one copy of the target's weights; transformers loads its own."""
    try:
        weights = weight_bytes(model, dtype)
    except (ValueError, KeyError, TypeError):
        return  # no transformers class for it: loading the model reports that
    engine = engine_bytes(model, weights, dtype, device)
    need = engine + (weights if config.baseline == "transformers" else 0)
    if available is None:
        available = _available_bytes(device)
    if available is None or need <= available:
        return
    gib = 1 << 30
    parts = [f"engines: {engine / gib:.1f} GiB"
             + (", the weights as CPU panels and the head's extra copies"
                if device.type == "cpu" else "")]
    if config.baseline == "transformers":
        parts.append(f"transformers: {weights / gib:.1f} GiB")
    hints = [h for h, useful in (("--baseline none", config.baseline == "transformers"),
                                 ("--dtype bfloat16", dtype == torch.float32),
                                 ("a smaller model", True)) if useful]
    raise JobError(f"--model {config.model} needs about {need / gib:.1f} GiB of {device.type} "
                   f"memory for its {str(dtype).removeprefix('torch.')} weights "
                   f"({'; '.join(parts)}), more than the "
                   f"{available / gib:.1f} GiB available; try {_either(hints)}")


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
        raise JobError(f"--drafter none: the k > 0 variants of --k "
                       f"{','.join(map(str, config.ks))} need a drafter (--k's default is "
                       "0,1,2,3,5); pass --k 0 to measure the engine without one")
    path = Path(option)
    if not (path / "config.json").is_file():
        raise JobError(f"--drafter {option}: not an EAGLE checkpoint directory (no config.json)")
    try:
        drafter_num_layers(path)  # reads its files' headers: a damaged file is refused here
    except (OSError, ValueError) as exc:
        raise JobError(f"--drafter {option}: {exc}") from None
    return path, option


def _either(options: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join([", ".join(options[:-1]), options[-1]] if len(options) > 1 else options)

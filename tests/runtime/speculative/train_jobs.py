"""The prompts and the small train-drafter job (the tiny target, float32 data, two steps) that
the training tests share."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from runtime.speculative.train_job import TrainDrafterJob
from runtime.speculative.training import TrainConfig

PROMPTS = ("Hello there", "What is two plus two?", "Name a colour.")


def _job(model_dir: Path, out: Path, **overrides: object) -> TrainDrafterJob:
    job = TrainDrafterJob(model=str(model_dir), prompt_ids=("a", "b", "c"), prompts=PROMPTS,
                          out_dir=out, train=TrainConfig(max_steps=2, batch_tokens=128),
                          max_answer_tokens=8, data_dtype="float32", save_dtype="float32")
    return dataclasses.replace(job, **overrides)  # type: ignore[arg-type]

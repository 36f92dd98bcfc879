"""A training run cut short (Ctrl-C or SIGTERM in training, a kill while answering, a line cut
by a crash): the step reached is saved and --resume ends as an uninterrupted run would; the
model card counts what ran, and a rerun's says how the answers it reused were made."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from jobs.cli import main
from runtime.speculative.train_job import TrainingInterrupted, run_train_drafter
from runtime.speculative.training import DrafterTrainer, TrainConfig
from tests.fixtures import make_tiny_checkpoint
from tests.runtime.speculative.train_jobs import PROMPTS, _job


def test_ctrl_c_in_training_saves_the_step_and_resume_ends_as_an_uninterrupted_run(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = TrainConfig(max_steps=5, batch_tokens=64, lr=3e-3, warmup_steps=1)
    whole = tmp_path / "whole"
    run_train_drafter(_job(tiny_model_dir, whole, train=train))
    cut = tmp_path / "cut"
    shutil.copytree(whole / "data", cut / "data")  # the same answers and features
    real_step = DrafterTrainer.train_step

    def interrupted_at_3(self: DrafterTrainer, batch: object) -> object:
        if self.step == 3:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(DrafterTrainer, "train_step", interrupted_at_3)
    with pytest.raises(TrainingInterrupted, match="^interrupted at step 3$"):
        run_train_drafter(_job(tiny_model_dir, cut, train=train))
    assert torch.load(cut / "checkpoint.pt", weights_only=False)["step"] == 3
    assert [r["step"] for r in json.loads((cut / "train_log.json").read_text())] == [1, 2, 3]
    assert not (cut / "model.safetensors").exists()
    monkeypatch.setattr(DrafterTrainer, "train_step", real_step)
    run_train_drafter(_job(tiny_model_dir, cut, train=train, resume=True))
    assert [r["step"] for r in json.loads((cut / "train_log.json").read_text())] == [1, 2, 3, 4, 5]
    mine, theirs = (load_file(str(d / "model.safetensors")) for d in (cut, whole))
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


def test_cli_sigterm_names_the_checkpoint_and_how_to_resume(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": list(PROMPTS)}), prompts)

    def stop(self: DrafterTrainer, batch: object) -> object:  # SIGTERM, handled as Ctrl-C
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(DrafterTrainer, "train_step", stop)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "d"
    result = CliRunner().invoke(main, ["train-drafter", "--model", str(tiny_model_dir),
                                       "--prompts", str(prompts), "--out", str(out),
                                       "--max-steps", "3", "--max-answer-tokens", "4"])
    assert result.exit_code == 130, result.output
    assert result.stderr.endswith(
        f"\ninterrupted at step 0; its checkpoint is saved in {out / 'checkpoint.pt'}: rerun the "
        "same command with --resume to continue\n")
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_model_card_counts_what_ran(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out, style="eagle3", num_layers=1))
    card = " ".join((out / "README.md").read_text().split())
    vocab = len(load_file(str(out / "model.safetensors"))["d2t"])
    assert "Style: eagle3, 1 decoder layer, trained with k = 3 unrolled draft steps" in card
    assert f"a draft vocabulary of the {vocab} most frequent tokens" in card
    assert "token-loss weight" not in card  # EAGLE-1's alone
    assert "Training accuracy (last 2 steps, per unrolled step)" in card


def test_a_run_killed_while_answering_names_its_target(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by QA: source.json was written after the answers, so the answers of a run killed
    while answering were later trained on for another target without a word."""
    from tqdm import tqdm

    from runtime.speculative import train_job
    from runtime.speculative.train_data import read_answers

    class Killed(tqdm):  # the kill, right after the first answer is written
        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self.desc == "answers" and self.n >= 1:
                raise KeyboardInterrupt
            return shown

    monkeypatch.setattr(train_job, "tqdm", Killed)
    out = tmp_path / "d"
    with pytest.raises(KeyboardInterrupt):
        run_train_drafter(_job(tiny_model_dir, out))
    monkeypatch.undo()
    assert len(read_answers(out / "data" / "answers.jsonl")) == 1
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match=r" holds answers and features of another target "):
        run_train_drafter(_job(other, out))


def test_a_line_cut_by_a_crash_is_made_again_on_a_line_of_its_own(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from runtime.speculative.train_data import read_answers

    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out))
    answers = out / "data" / "answers.jsonl"
    whole = answers.read_bytes()
    cut = tmp_path / "cut"
    (cut / "data").mkdir(parents=True)
    shutil.copy(out / "data" / "source.json", cut / "data")
    (cut / "data" / "answers.jsonl").write_bytes(whole[:-40])  # the last answer cut
    run_train_drafter(_job(tiny_model_dir, cut))
    assert read_answers(cut / "data" / "answers.jsonl") == read_answers(answers)
    assert (cut / "data" / "answers.jsonl").read_bytes() == whole


def test_the_model_card_of_a_rerun_that_reused_every_answer_says_how_they_were_made(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found by QA: it described this run's answer options, which made none of them."""
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out, answer_samples=1, answer_temperature=0.7))
    card = " ".join((out / "README.md").read_text().split())
    assert ("our engine (chat template, at most 8 tokens, target in float32) for the prompts"
            in card)
    assert "its greedy answer to each and 1 sampled at temperature 0.7;" in card
    run_train_drafter(_job(tiny_model_dir, out, answer_samples=1, answer_temperature=2.0,
                           max_answer_tokens=64, resume=True,
                           train=TrainConfig(max_steps=3, batch_tokens=128)))
    card = " ".join((out / "README.md").read_text().split())
    assert ("our engine (chat template; made by earlier runs of the job, at most 8 tokens, "
            "target in float32) for the prompts") in card
    assert "its greedy answer to each and 1 sampled at temperature 0.7;" in card

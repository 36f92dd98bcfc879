"""The files of train-drafter's --out that are not its own (a drafter, a README.md, a
train_log.json) are neither replaced nor read as its own, and a file of --out it cannot write is
named in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from jobs.cli import main
from runtime.speculative.train_job import run_train_drafter
from tests.runtime.speculative.train_jobs import PROMPTS, _job


def test_an_out_holding_a_drafter_without_checkpoint_is_not_overwritten(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    run_train_drafter(_job(tiny_model_dir, first))
    (first / "checkpoint.pt").unlink()  # a drafter as shipped: no training state beside it
    before = (first / "model.safetensors").read_bytes()
    for job in (_job(tiny_model_dir, first), _job(tiny_model_dir, first, init_drafter=first)):
        with pytest.raises(FileExistsError) as err:
            run_train_drafter(job)
        assert str(err.value) == (f"{first} holds a drafter (config.json, model.safetensors) "
                                  "that this job would replace; choose another --out, or remove "
                                  "them")
    assert (first / "model.safetensors").read_bytes() == before


def test_a_readme_of_the_users_own_in_out_is_not_replaced(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "d"
    out.mkdir()
    (out / "README.md").write_text("# my project\n")
    with pytest.raises(FileExistsError) as err:
        run_train_drafter(_job(tiny_model_dir, out))
    assert str(err.value) == (f"{out / 'README.md'} is not a drafter's model card, and this job "
                              "would replace it; choose another --out, or remove it")
    assert sorted(os.listdir(out)) == ["README.md"]


def test_a_train_log_of_the_users_own_is_not_replaced_nor_extended(tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """A train_log.json without this job's checkpoint was replaced; on --resume one that is
    not a list of steps failed after the answers and features had been made."""
    out = tmp_path / "d"
    out.mkdir()
    (out / "train_log.json").write_text('{"mine": 1}\n')
    with pytest.raises(FileExistsError) as err:
        run_train_drafter(_job(tiny_model_dir, out))
    assert str(err.value) == (f"{out / 'train_log.json'} is not this training's log, and this "
                              "job would replace it; choose another --out, or remove it")
    assert sorted(os.listdir(out)) == ["train_log.json"]
    (out / "train_log.json").unlink()
    run_train_drafter(_job(tiny_model_dir, out))
    steps = json.loads((out / "train_log.json").read_text())
    assert [s["step"] for s in steps] == [1, 2]
    for text, why in (('{"mine": 1}', "not a list of steps"),
                      ("[{", "Expecting property name enclosed in double quotes: line 1 column 3 "
                             "(char 2)")):
        (out / "train_log.json").write_text(text)
        answers = (out / "data" / "answers.jsonl").read_text()
        with pytest.raises(ValueError) as err:
            run_train_drafter(_job(tiny_model_dir, out, resume=True, prompts=PROMPTS * 2,
                                   prompt_ids=("a", "b", "c", "d", "e", "f")))
        assert str(err.value) == (f"--resume: {out / 'train_log.json'} is not this training's "
                                  f"log ({why}); remove it to start a new one")
        assert (out / "data" / "answers.jsonl").read_text() == answers  # no work was done


def test_cli_names_a_file_of_out_it_cannot_write(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A directory where answers.jsonl goes (or a full disk) gave a traceback."""
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": list(PROMPTS)}), prompts)
    out = tmp_path / "d"
    (out / "data" / "answers.jsonl").mkdir(parents=True)
    result = CliRunner().invoke(main, ["train-drafter", "--model", str(tiny_model_dir),
                                       "--prompts", str(prompts), "--out", str(out),
                                       "--max-steps", "1", "--max-answer-tokens", "4"])
    assert result.exit_code == 2
    assert result.stderr.endswith(f"\nerror: {out / 'data' / 'answers.jsonl'}: Is a directory\n")

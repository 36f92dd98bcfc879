"""What train-drafter refuses or leaves out before any work: data of another target, options
that do not fit the target, prompts too long for its context (in training and in the held-out
evaluation), answers to other prompts under the same ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.speculative.train_job import run_train_drafter
from tests.fixtures import make_tiny_checkpoint
from tests.runtime.speculative.train_jobs import PROMPTS, _job


def test_data_of_another_target_or_other_features_is_refused_before_any_work(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out))
    source = json.loads((out / "data" / "source.json").read_text())
    assert source["feature_layers"] == [-1]
    assert source["runs"] == [{"prompts": "", "answers": 3, "max_answer_tokens": 8,
                               "data_dtype": "float32", "answer_samples": 0, "first_sample": 1,
                               "answer_temperature": None}]
    # the same shape, other weights: only the digest tells them apart
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    moved = tmp_path / "moved"
    shutil.copytree(out / "data", moved / "data")
    answers = (moved / "data" / "answers.jsonl").read_text()
    for job in (_job(other, out, resume=True), _job(other, moved)):
        with pytest.raises(ValueError) as err:
            run_train_drafter(job)
        data = job.out_dir / "data"
        assert str(err.value) == (
            f"{data} holds answers and features of another target ({str(tiny_model_dir)!r}, "
            f"other config or weights) than --model {str(other)!r}; they do not fit it: choose "
            f"another --out, or remove {data}")
    assert (moved / "data" / "answers.jsonl").read_text() == answers  # nothing was added
    with pytest.raises(ValueError) as err:
        run_train_drafter(_job(tiny_model_dir, moved, style="eagle3"))
    assert str(err.value) == (
        f"{moved / 'data'} holds features of the target's hidden states (-1,), but this drafter "
        f"needs (0, 1, 1) (another --style); choose another --out, or remove the "
        f"features-*.safetensors files in {moved / 'data'}")
    # the same target under another name (a copy of its directory) is the same target
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    run_train_drafter(_job(copy, moved))
    assert (moved / "data" / "answers.jsonl").read_text() == answers


@pytest.mark.parametrize("overrides, message", [
    ({"draft_head_size": 300}, "--draft-head-size 300 is larger than the target's vocabulary "
                               "(256 tokens)"),
    ({"draft_head_size": 20, "style": "eagle3"},
     "--draft-head-size is for --style eagle1; an EAGLE-3 drafter has its own head over its "
     "draft vocabulary (--draft-vocab-size)"),
    ({"num_layers": 3}, "--layers 3 is more than the target's 2 layers (the drafter's layers "
                        "start as copies of the target's last ones)"),
])
def test_options_that_do_not_fit_the_target_are_refused_before_any_work(
        tiny_model_dir: Path, tmp_path: Path, overrides: dict, message: str) -> None:
    out = tmp_path / "d"
    with pytest.raises(ValueError) as err:
        run_train_drafter(_job(tiny_model_dir, out, **overrides))
    assert str(err.value) == message
    assert not out.exists()


def test_no_answer_to_train_on_is_refused_not_looped_on(tiny_model_dir: Path,
                                                       tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Prompts all longer than the target's context gave no answer, and training looked for a
    first batch forever at full CPU; a prompt left out that way was not said."""
    long = "word " * 600  # over the tiny target's 512 positions
    with pytest.raises(ValueError, match=r"no answers to train on: the target answered none of "
                                         r"the 2 prompt\(s\) \(too long for its context of 512 "
                                         r"tokens"):
        run_train_drafter(_job(tiny_model_dir, tmp_path / "d", prompt_ids=("a", "b"),
                               prompts=(long, long)))
    assert "note: 2 of 2 answers could not be made and are left out (prompt a: " in (
        capsys.readouterr().err)


def test_evaluation_stops_at_the_context_and_counts_the_prompts_it_ran(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The held-out evaluation ran with a context of 2048 on a 512-position target, and counted
    prompts it could not run."""
    from runtime.speculative.train_eval import evaluate  # noqa: PLC0415
    from tests.drafter_fixtures import make_random_drafter  # noqa: PLC0415

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=1)
    result = evaluate(str(tiny_model_dir), drafter, ["word " * 600, "Hello there"], 2, 600,
                      max_model_len=512)
    assert result.num_prompts == 1  # the long one cannot run
    assert 0 < result.num_tokens <= 512 - 10  # its answer ends at the context's end


def test_answers_to_other_prompts_under_the_same_ids_are_refused(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found in a review: answers were reused by id alone, so a second run on other prompts (or
    another column) under the same ids trained on the first run's answers without a word."""
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out, answer_samples=1))
    answers = out / "data" / "answers.jsonl"
    made = answers.read_text()
    assert sorted(json.loads(line)["id"] for line in made.splitlines()) == [
        "a", "a#s1", "b", "b#s1", "c", "c#s1"]
    # the same prompts under the same ids: every answer is reused, nothing is made again
    run_train_drafter(_job(tiny_model_dir, out, answer_samples=1, resume=True))
    assert answers.read_text() == made
    # prompt "b" changed: its greedy and sampled answers are stale; refused before any work
    changed = (PROMPTS[0], "What is three plus three?", PROMPTS[2])
    with pytest.raises(ValueError) as err:
        run_train_drafter(_job(tiny_model_dir, out, prompts=changed, answer_samples=1,
                               resume=True))
    assert str(err.value) == (
        f"{answers} holds 2 answer(s) to other prompts under this run's ids (first: 'b'): the "
        f"prompts, their column or the chat template changed since they were made; choose "
        f"another --out, or remove {out / 'data'}")
    assert answers.read_text() == made
    # other ids, even for changed prompts, add answers beside the old ones
    shutil.copytree(out / "data", tmp_path / "f" / "data")
    run_train_drafter(_job(tiny_model_dir, tmp_path / "f", prompt_ids=("x", "y", "z"),
                           prompts=changed))
    ids = [json.loads(line)["id"] for line in
           (tmp_path / "f" / "data" / "answers.jsonl").read_text().splitlines()]
    assert ids[:6] == [json.loads(line)["id"] for line in made.splitlines()]
    assert sorted(ids[6:]) == ["x", "y", "z"]

"""What train-drafter refuses before any work (data of another target, a drafter it would
replace, options that do not fit), and Ctrl-C during training: the step reached is saved and
--resume ends with the weights of an uninterrupted run."""

from __future__ import annotations

import dataclasses
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
from runtime.speculative.train_job import TrainDrafterJob, TrainingInterrupted, run_train_drafter
from runtime.speculative.training import DrafterTrainer, TrainConfig
from tests.fixtures import make_tiny_checkpoint

PROMPTS = ("Hello there", "What is two plus two?", "Name a colour.")


def _job(model_dir: Path, out: Path, **overrides: object) -> TrainDrafterJob:
    job = TrainDrafterJob(model=str(model_dir), prompt_ids=("a", "b", "c"), prompts=PROMPTS,
                          out_dir=out, train=TrainConfig(max_steps=2, batch_tokens=128),
                          max_answer_tokens=8, data_dtype="float32", save_dtype="float32")
    return dataclasses.replace(job, **overrides)  # type: ignore[arg-type]


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


def test_cli_refuses_a_prompt_column_of_numbers_and_a_zero_time_budget(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"prompt": [1, 2]}), numbers)
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": list(PROMPTS)}), good)
    base = ["train-drafter", "--model", str(tiny_model_dir), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(main, [*base, "--prompts", str(numbers), "--max-steps", "1"])
    assert result.exit_code == 2
    assert (f"Invalid value for --prompts: {numbers}: column 'prompt' is int64, not string"
            in " ".join(result.output.split()))
    for budget in ("0m", "0"):
        result = CliRunner().invoke(main, [*base, "--prompts", str(good), "--time-budget",
                                           budget])
        assert result.exit_code == 2
        assert (f"Invalid value for --time-budget: '{budget}' leaves no time to train; give "
                "more than 0" in " ".join(result.output.split()))
    assert not (tmp_path / "o").exists()


def test_the_model_card_counts_what_ran(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out, style="eagle3", num_layers=1))
    card = " ".join((out / "README.md").read_text().split())
    vocab = len(load_file(str(out / "model.safetensors"))["d2t"])
    assert "Style: eagle3, 1 decoder layer, trained with k = 3 unrolled draft steps" in card
    assert f"a draft vocabulary of the {vocab} most frequent tokens" in card
    assert "token-loss weight" not in card  # EAGLE-1's alone
    assert "Training accuracy (last 2 steps, per unrolled step)" in card


def test_cli_refuses_repeated_or_null_ids_and_leaves_out_prompts_not_utf8(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found by a reviewer: a repeated id merged two prompts' answers under one (the second
    never answered), a null id became 'None', and bytes that are not UTF-8 gave a traceback."""
    from jobs.train_drafter import read_prompts  # noqa: PLC0415

    repeated = tmp_path / "repeated.parquet"
    pq.write_table(pa.table({"id": [1, 2, 1], "prompt": list(PROMPTS)}), repeated)
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"id": [None, "b", "c"], "prompt": list(PROMPTS)}), nulls)
    base = ["train-drafter", "--model", str(tiny_model_dir), "--out", str(tmp_path / "o"),
            "--max-steps", "1"]
    for path, why in ((repeated, "duplicate id 1 in column 'id' (rows 0 and 2); ids must be "
                                 "unique"), (nulls, "column 'id' is null at row 0")):
        result = CliRunner().invoke(main, [*base, "--prompts", str(path)])
        assert result.exit_code == 2
        assert f"Invalid value for --prompts: {path}: {why}" in " ".join(result.output.split())
    assert not (tmp_path / "o").exists()
    binary = tmp_path / "binary.parquet"
    pq.write_table(pa.table({"prompt": pa.array([b"Hello", b"caf\xe9 au lait", b"Hi"],
                                                pa.binary())}).cast(
        pa.schema([("prompt", pa.string())]), safe=False), binary)
    ids, prompts = read_prompts(binary)
    assert (ids, prompts) == (("0", "2"), ("Hello", "Hi"))


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


def test_cli_trains_on_chats_of_a_messages_column(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--messages-column: the target answers each chat's next turn, its prompt rendered as the
    generate job renders it; chats that cannot be rendered are left out, said."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             [{"role": "user", "content": None}],
             [{"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}],
             []]
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "chat": chats}), path)
    out = tmp_path / "o"
    base = ["train-drafter", "--model", str(tiny_model_dir), "--out", str(out), "--max-steps",
            "1", "--max-answer-tokens", "4", "--data-dtype", "float32", "--batch-tokens", "128"]
    result = CliRunner().invoke(main, [*base, "--prompts", str(path)])
    assert result.exit_code == 2
    assert (f"Invalid value for --prompts: {path} has no 'prompt' column (--prompt-column; "
            "columns: id, chat; chat column(s) chat: --messages-column)"
            in " ".join(result.output.split()))
    result = CliRunner().invoke(main, [*base, "--prompts", str(path), "--messages-column", "id"])
    assert result.exit_code == 2
    assert (f"{path}: column 'id' is string, not list<struct<role: string, content: string>> "
            "(--messages-column)" in " ".join(result.output.split()))
    result = CliRunner().invoke(main, [*base, "--prompts", str(path), "--messages-column", "chat"])
    assert result.exit_code == 0, result.output
    assert (f"note: --prompts {path}: left out 2 chat(s) that cannot be rendered (row 1: "
            "messages[0] (user) has null content, ...)") in result.stderr
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    answers = {row["id"]: row["prompt_ids"] for row in map(
        json.loads, (out / "data" / "answers.jsonl").read_text().splitlines())}
    assert answers == {i: tokenizer(tokenizer.apply_chat_template(
        chats[n], tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"] for i, n in (("a", 0), ("c", 2))}
    # a target without a chat template cannot render chats: refused, named
    raw = tmp_path / "raw"
    shutil.copytree(tiny_model_dir, raw)
    config = json.loads((raw / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (raw / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in raw.glob("chat_template.*"):
        extra.unlink()
    result = CliRunner().invoke(main, [*base[:2], str(raw), *base[3:4], str(tmp_path / "o2"),
                                       *base[5:], "--prompts", str(path),
                                       "--messages-column", "chat"])
    assert (result.exit_code, result.stderr.splitlines()[-1]) == (
        2, "error: --messages-column: the target's tokenizer has no chat template to render "
           "chats with"), result.output


def test_chats_the_chat_template_refuses_are_left_out_with_a_note(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found by a reviewer: a chat the template raises on (a system message where roles must
    alternate, as Mistral's templates say) gave a jinja2 traceback, before any answer, or after
    training when it was among --eval-prompts, with no model card."""
    model = tmp_path / "strict"
    shutil.copytree(tiny_model_dir, model)
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
              "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant:{% endif %}")
    (model / "chat_template.jinja").write_text(strict)
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             [{"role": "user", "content": "Name a colour."}],
             [{"role": "user", "content": "Count to three."}]]
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "chat": chats}), path)
    out = tmp_path / "o"
    result = CliRunner().invoke(main, [
        "train-drafter", "--model", str(model), "--out", str(out), "--max-steps", "1",
        "--max-answer-tokens", "4", "--data-dtype", "float32", "--batch-tokens", "128",
        "--prompts", str(path), "--messages-column", "chat", "--eval-prompts", str(path),
        "--eval-max-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert ("note: 1 of 3 answers could not be made and are left out (prompt a: chat template "
            "failed: Conversation roles must alternate)") in result.stderr
    answers = [json.loads(line)["id"] for line in
               (out / "data" / "answers.jsonl").read_text().splitlines()]
    assert sorted(answers) == ["b", "c"]
    assert "evaluation on 2 held-out prompts" in " ".join((out / "README.md").read_text().split())


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


def test_cli_refuses_ids_spelled_as_a_sampled_answers(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    """'a#s1' is the id of prompt a's first sampled answer: as a prompt's id, two answers
    shared it."""
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", "a#s1", "b"], "prompt": list(PROMPTS)}), prompts)
    result = CliRunner().invoke(main, ["train-drafter", "--model", str(tiny_model_dir),
                                       "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                                       "--max-steps", "1"])
    assert result.exit_code == 2
    assert (f"Invalid value for --prompts: {prompts}: id 'a#s1' at row 1 ends like a sampled "
            "answer's id ('<prompt id>#s<n>'); ids must not end in '#s' and a number") in (
        " ".join(result.output.split()))
    assert not (tmp_path / "o").exists()


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

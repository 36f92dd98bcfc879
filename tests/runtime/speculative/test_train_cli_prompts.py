"""The prompts file train-drafter reads, through the CLI: a prompt column that is not text, ids
repeated, null or spelled as a sampled answer's, bytes that are not UTF-8, chats of a messages
column and the chats a chat template refuses; and a time budget that leaves no time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from jobs.cli import main
from tests.runtime.speculative.train_jobs import PROMPTS


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

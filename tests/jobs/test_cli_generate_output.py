"""`eaglebatch generate` through the real CLI and the real engine on the tiny checkpoint: the
documented schema, one row per input row (n samples each), ids, per-row overrides, a resume,
a lossless drafter, and the notes on the model's chat template, generation config and
context."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.drafter_fixtures import make_random_drafter
from tests.jobs.generate_cases import PROMPTS, _generate
from tests.pipeline.helpers import read_parts, write_parquet

GENERATED = [
    ("completion", pa.string()), ("completion_token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()), ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()), ("num_drafted", pa.int32()), ("num_accepted", pa.int32()),
    ("max_tokens_clamped", pa.bool_()), ("error", pa.string()),
]


def _types(table: pa.Table | pa.Schema) -> list[tuple[str, pa.DataType]]:
    schema = table if isinstance(table, pa.Schema) else table.schema
    return [(f.name, f.type) for f in schema]


def test_generate_writes_the_documented_schema_one_row_per_input_row(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    inputs = pa.table({
        "id": pa.array([10, 11, 12, 13, 14, 15, 16], pa.int64()),
        "prompt": PROMPTS,
        "score": [0.5, None, 1.5, 2.0, 2.5, 3.0, 3.5],
        "tags": [["a"], [], None, ["b", "c"], ["d"], ["e"], ["f"]],
        "meta": [{"src": "x", "n": i} for i in range(7)],
    })
    path = write_parquet(tmp_path / "in.parquet", dict(zip(inputs.column_names, inputs.columns,
                                                           strict=True)), row_group_size=2)
    result = _generate(tiny_model_dir, path, tmp_path / "out", "--shard-rows", "3",
                       "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    assert "done: 7 rows (0 errors), " in result.stdout
    assert sorted(n for n in os.listdir(tmp_path / "out") if not n.startswith(".")) == [
        "_SUCCESS", "manifest.json", "part-00000.parquet", "part-00001.parquet",
        "part-00002.parquet", "stats.parquet"]
    table = read_parts(tmp_path / "out")
    assert _types(table) == _types(inputs) + GENERATED
    assert table.column("id").to_pylist() == [10, 11, 12, 13, 14, 15, 16]
    assert table.select(inputs.column_names).equals(inputs)
    assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert all(0 < n <= 5 for n in table.column("completion_tokens").to_pylist())
    assert table.column("error").null_count == 7
    # the job is complete: a signal while the process exits no longer turns exit 0 into a kill
    assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_no_id_column_ids_from_file_stem_and_row(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "chunk.parquet", {"prompt": PROMPTS[:3]})
    result = _generate(tiny_model_dir, path, tmp_path / "out", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    table = read_parts(tmp_path / "out")
    assert table.schema.names[:2] == ["id", "prompt"]
    assert table.column("id").to_pylist() == ["chunk:0", "chunk:1", "chunk:2"]


def test_n_2_writes_sample_index_and_a_rerun_draws_the_same_samples(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"id": ["a", "b", "c"], "prompt": PROMPTS[:3]})
    args = ("--n", "2", "--temperature", "1.0", "--seed", "3", "--max-tokens", "8")
    first = _generate(tiny_model_dir, path, tmp_path / "out1", *args)
    second = _generate(tiny_model_dir, path, tmp_path / "out2", *args, "--shard-rows", "1")
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    table = read_parts(tmp_path / "out1")
    assert table.column("id").to_pylist() == ["a", "a", "b", "b", "c", "c"]
    assert table.column("sample_index").to_pylist() == [0, 1, 0, 1, 0, 1]
    assert table.schema.field("sample_index").type == pa.int32()
    ids = table.column("completion_token_ids").to_pylist()
    assert ids[0::2] != ids[1::2]  # the two samples of a row are not the same draw
    rerun = read_parts(tmp_path / "out2").column("completion_token_ids").to_pylist()
    assert rerun == ids  # whatever the sharding, the same seeds


def test_per_row_overrides_messages_and_error_rows(tmp_path: Path, tiny_model_dir: Path) -> None:
    msgs = [[{"role": "user", "content": "Hi"}], [], [{"role": "user", "content": "Tell me"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]]
    path = write_parquet(tmp_path / "in.parquet", {
        "id": ["m0", "m1", "m2", "m3"], "msgs": msgs,
        "max_tokens": pa.array([1, None, 3, 600], pa.int64())})
    result = _generate(tiny_model_dir, path, tmp_path / "out", "--messages-column", "msgs",
                       "--max-tokens", "6")
    assert result.exit_code == 0, result.output
    assert "done: 4 rows (1 error), " in result.stdout
    rows = read_parts(tmp_path / "out").to_pylist()
    assert [r["finish_reason"] for r in rows[:3]] == ["length", "error", "length"]
    assert [r["completion_tokens"] for r in rows[:3]] == [1, 0, 3]
    # 600 tokens do not fit the 512-token context: clamped to 512 - prompt (EOS may come sooner)
    assert [r["max_tokens_clamped"] for r in rows] == [False, False, False, True]
    assert rows[3]["completion_tokens"] <= 512 - rows[3]["prompt_tokens"]
    assert rows[1]["error"] == "messages is empty"


def test_resume_after_losing_a_part_file_regenerates_only_that_shard(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(7)), "prompt": PROMPTS})
    out = tmp_path / "out"
    args = ("--shard-rows", "2", "--max-tokens", "6")
    assert _generate(tiny_model_dir, path, out, *args).exit_code == 0
    before = read_parts(out)
    kept = {n: os.stat(out / n).st_mtime_ns for n in ("part-00000.parquet", "part-00003.parquet")}
    (out / "part-00002.parquet").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["shards"]["2"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = _generate(tiny_model_dir, path, out, *args)
    assert result.exit_code == 0, result.output
    assert "resuming: 3 of 4 shards done" in result.stderr
    assert read_parts(out).equals(before)
    assert {n: os.stat(out / n).st_mtime_ns for n in kept} == kept


def test_drafter_is_lossless_and_its_acceptance_is_reported(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter", num_layers=2)
    path = write_parquet(tmp_path / "in.parquet", {"id": [0, 1, 2], "prompt": PROMPTS[:3]})
    args = ("--max-tokens", "12", "--shard-rows", "2")
    plain = _generate(tiny_model_dir, path, tmp_path / "plain", *args, "--drafter", "none")
    spec = _generate(tiny_model_dir, path, tmp_path / "spec", *args, "--drafter", str(drafter),
                     "--num-speculative-tokens", "3",
                     "--draft-confidence", "0")  # random drafter: its confidence means nothing
    assert plain.exit_code == 0 and spec.exit_code == 0, plain.output + spec.output
    assert "acceptance rate" not in plain.stdout
    assert "acceptance rate " in spec.stdout and "per position [" in spec.stdout
    with_drafter = read_parts(tmp_path / "spec")
    assert (with_drafter.column("completion_token_ids").to_pylist()
            == read_parts(tmp_path / "plain").column("completion_token_ids").to_pylist())
    assert sum(with_drafter.column("num_drafted").to_pylist()) > 0
    stats = pq.read_table(tmp_path / "spec" / "stats.parquet").to_pylist()
    assert [s["shard_id"] for s in stats] == [0, 1]
    for s in stats:
        assert s["drafted"] > 0 and s["acceptance_rate"] == s["accepted"] / s["drafted"]
        assert len(s["per_position_acceptance"]) == 3
        assert s["mean_acceptance_length"] >= 1.0
    manifest = json.loads((tmp_path / "spec" / "manifest.json").read_text())
    assert manifest["config"]["drafter"] == str(drafter)
    # --k is the same option, as bench names it: the same job (a rerun of it resumes as done)
    same = _generate(tiny_model_dir, path, tmp_path / "spec", *args, "--drafter", str(drafter),
                     "--k", "3", "--draft-confidence", "0")
    assert same.exit_code == 0 and "resuming: 2 of 2 shards done" in same.stderr, same.output
    assert "note: nothing was drafted" not in plain.stderr + spec.stderr
    # three requests that run side by side to the end never make a step of one: say why
    capped = _generate(tiny_model_dir, path, tmp_path / "capped", "--max-tokens", "3",
                       "--drafter", str(drafter), "--draft-max-batch", "1")
    assert capped.exit_code == 0, capped.output
    assert sum(read_parts(tmp_path / "capped").column("num_drafted").to_pylist()) == 0
    assert capped.stderr.endswith(
        "note: nothing was drafted: requests draft only in steps of at most 1 request "
        "(--draft-max-batch); a request's drafts stop where the drafter's confidence falls below "
        "0.15 (--draft-confidence)\n")


def test_a_model_without_a_chat_template_says_prompts_are_raw_text(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": ["Paris is"]})
    result = _generate(model, inputs, tmp_path / "out", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert (f"note: the tokenizer of {model} has no chat template: prompts are tokenized as raw "
            "text, as with --no-chat-template\n") in result.stderr
    with_template = _generate(tiny_model_dir, inputs, tmp_path / "out2", "--max-tokens", "2")
    assert "chat template" not in with_template.stderr


def test_generation_config_fields_the_engine_does_not_apply_are_named(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Found by a reviewer: transformers' greedy generate applies a checkpoint's repetition
    penalty (Qwen2.5-Instruct ships 1.05), the engine does not, and nothing said so."""
    model = tmp_path / "penalised"
    shutil.copytree(tiny_model_dir, model)
    fields = json.loads((model / "generation_config.json").read_text())
    fields.update(repetition_penalty=1.05, no_repeat_ngram_size=0, temperature=0.7,
                  suppress_tokens=[5, 6], min_new_tokens=0, num_beams=None, min_length=None)
    (model / "generation_config.json").write_text(json.dumps(fields))
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": ["Paris is"]})
    result = _generate(model, inputs, tmp_path / "out", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert (f"note: the generation_config.json of {model} sets repetition_penalty 1.05, "
            "suppress_tokens [5, 6], which transformers' generate applies and eaglebatch does "
            "not (--repetition-penalty can apply it)\n") in result.stderr
    # a job that sets its own repetition penalty applies it: the note names the rest
    penalized = _generate(model, inputs, tmp_path / "out3", "--max-tokens", "2",
                          "--repetition-penalty", "1.05")
    assert (f"note: the generation_config.json of {model} sets suppress_tokens [5, 6], which "
            "transformers' generate applies and eaglebatch does not\n") in penalized.stderr
    plain = _generate(tiny_model_dir, inputs, tmp_path / "out2", "--max-tokens", "2")
    assert "generation_config" not in plain.stderr


def test_max_model_len_clamps_rows_to_the_context_it_sets(tmp_path: Path,
                                                          tiny_model_dir: Path) -> None:
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": ["Paris is", "word " * 30]})
    result = _generate(tiny_model_dir, inputs, tmp_path / "out", "--max-tokens", "40",
                       "--max-model-len", "24", "--no-chat-template")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pylist()
    assert rows[0]["max_tokens_clamped"] is True and rows[0]["error"] is None
    assert rows[0]["prompt_tokens"] + rows[0]["completion_tokens"] <= 24
    assert rows[1]["finish_reason"] == "error"
    assert "the model's context is 24 tokens" in rows[1]["error"]
    assert "past the context" not in result.stderr
    longer = _generate(tiny_model_dir, inputs, tmp_path / "out2", "--max-tokens", "2",
                       "--max-model-len", "600", "--no-chat-template")
    assert longer.exit_code == 0, longer.output
    assert (f"note: --max-model-len 600 is past the context of {tiny_model_dir} (512 tokens): "
            "positions beyond it are ones the model was not trained on\n") in longer.stderr

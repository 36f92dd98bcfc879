"""run_job resumed, with the real engine on the tiny checkpoint (no fakes): only missing or
damaged shards are generated again, a report in OUTPUT_DIR is rewritten; other options, another
attention backend or device, other model weights or a changed input are refused until
--overwrite; stale temp files are removed."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig, JobError
from pipeline.job import run_job
from runtime.config import EngineConfig
from runtime.engine import Engine
from tests.pipeline.helpers import hidden_files, read_parts, write_parquet
from tests.pipeline.job_cases import PROMPTS_B, _config, _factory, _inputs


def _finished_job(tmp_path: Path, model_dir: Path, engine: Engine
                  ) -> tuple[JobConfig, Path, pa.Table]:
    """The job over _inputs run to the end: its config, OUTPUT_DIR and rows."""
    _inputs(tmp_path)
    config = _config(tmp_path, model_dir)
    run_job(config, _factory(engine), progress=False)
    out = tmp_path / "out"
    return config, out, read_parts(out)


def test_resume_regenerates_only_the_missing_shard(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        capsys: pytest.CaptureFixture[str]) -> None:
    config, out, before = _finished_job(tmp_path, tiny_model_dir, tiny_engine)
    mtimes = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out) if n.startswith("part-")}
    (out / "part-00001.parquet").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["shards"]["1"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "_SUCCESS").unlink()
    capsys.readouterr()
    summary = run_job(config, _factory(tiny_engine), progress=False)
    assert "resuming: 4 of 5 shards done" in capsys.readouterr().err
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (4, 1, True)
    assert read_parts(out).equals(before)
    for name, mtime in mtimes.items():
        if name != "part-00001.parquet":
            assert os.stat(out / name).st_mtime_ns == mtime, name
    assert (out / "_SUCCESS").exists()
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert [r["runner"] for r in runs] == ["local", "local"]
    # a rerun of the finished job generates nothing, is not recorded as a run, and loads no
    # model (a 7B model's minute, for nothing)
    built: list[EngineConfig] = []
    summary = run_job(config, _factory(tiny_engine, built), progress=False)
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (5, 0, True)
    assert json.loads((out / "manifest.json").read_text())["runs"] == runs
    assert built == []


def test_a_report_in_output_dir_is_written_again_when_the_job_goes_on(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.bench.job_report import write_job_report

    config, out, _ = _finished_job(tmp_path, tiny_model_dir, tiny_engine)
    (out / "part-00001.parquet").unlink()
    (out / "_SUCCESS").unlink()
    write_job_report(str(out), str(out))
    assert "- 5 of 5 shards committed; not complete" in (out / "report.md").read_text()
    capsys.readouterr()
    run_job(config, _factory(tiny_engine), progress=False)
    assert capsys.readouterr().err.endswith(f"wrote {out / 'report.md'} again (it was there)\n")
    assert "- 5 of 5 shards committed; complete (_SUCCESS written)" in (
        out / "report.md").read_text()
    # a rerun of a finished job generates nothing, and leaves the report alone
    before = (out / "report.md").read_text()
    run_job(config, _factory(tiny_engine), progress=False)
    assert (out / "report.md").read_text() == before
    # a report.md of the user's own is theirs
    (out / "report.md").write_text("# my notes\n")
    (out / "part-00001.parquet").unlink()
    run_job(config, _factory(tiny_engine), progress=False)
    assert (out / "report.md").read_text() == "# my notes\n"


def test_a_damaged_part_file_of_a_finished_job_is_generated_again(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        capsys: pytest.CaptureFixture[str]) -> None:
    config, out, before = _finished_job(tmp_path, tiny_model_dir, tiny_engine)
    part = out / "part-00003.parquet"
    part.write_bytes(part.read_bytes()[:100])
    capsys.readouterr()
    summary = run_job(config, _factory(tiny_engine), progress=False)
    assert "part-00003.parquet of committed shard 3 is unreadable (" in capsys.readouterr().err
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (4, 1, True)
    assert read_parts(out).equals(before)
    assert (out / "_SUCCESS").exists()


def test_other_options_are_refused_until_overwrite(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    _inputs(tmp_path)
    run_job(_config(tmp_path, tiny_model_dir), _factory(tiny_engine), progress=False)
    out = tmp_path / "out"
    (out / "notes.txt").write_text("mine")
    manifest = (out / "manifest.json").read_text()
    with pytest.raises(JobError) as err:
        run_job(_config(tmp_path, tiny_model_dir, max_tokens=3), _factory(tiny_engine),
                progress=False)
    assert str(err.value) == (f"{out} holds the outputs of a different job (sampling.max_tokens: "
                              f"6 -> 3); rerun with --overwrite to discard them, or choose "
                              f"another OUTPUT_DIR")
    assert (out / "manifest.json").read_text() == manifest
    run_job(_config(tmp_path, tiny_model_dir, max_tokens=3, overwrite=True),
            _factory(tiny_engine), progress=False)
    assert max(read_parts(out).column("completion_tokens").to_pylist()) == 3
    assert (out / "notes.txt").read_text() == "mine"


def test_max_model_len_equal_to_the_models_context_is_the_same_job(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """A manifest records --max-model-len as given (null: the model's context, 512 for the
    tiny checkpoint). Giving the model's context on a resume, or leaving out the context a job
    was started with, is the same job; another length is refused."""
    config, out, _ = _finished_job(tmp_path, tiny_model_dir, tiny_engine)
    (out / "part-00002.parquet").unlink()
    recorded = json.loads((out / "manifest.json").read_text())["config"]
    assert recorded["max_model_len"] is None

    def with_length(length: int, **kw: Any) -> JobConfig:
        engine = dataclasses.replace(config.engine, max_model_len=length)
        return dataclasses.replace(config, engine=engine, **kw)

    summary = run_job(with_length(512), _factory(tiny_engine), progress=False)
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (4, 1, True)
    assert json.loads((out / "manifest.json").read_text())["config"] == recorded
    with pytest.raises(JobError) as err:
        run_job(with_length(256), _factory(tiny_engine), progress=False)
    assert str(err.value).startswith(f"{out} holds the outputs of a different job "
                                     "(max_model_len: None -> 256); ")
    run_job(with_length(512, overwrite=True), _factory(tiny_engine), progress=False)
    (out / "part-00000.parquet").unlink()
    summary = run_job(config, _factory(tiny_engine), progress=False)
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (4, 1, True)
    assert json.loads((out / "manifest.json").read_text())["config"]["max_model_len"] == 512


def test_another_attention_backend_or_device_is_another_job(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """The attention backends sum in other orders, so greedy tokens may differ: the manifest
    keeps what the options resolved to on the machine that ran it (the local runner), and a
    resume that would run elsewhere is refused; the same place spelled out ('cpu' for 'auto')
    is the same job, and so is a finished job's rerun (it generates nothing). A manifest
    written before they were kept still resumes."""
    config, out, _ = _finished_job(tmp_path, tiny_model_dir, tiny_engine)
    recorded = json.loads((out / "manifest.json").read_text())
    assert recorded["config"]["placement"] == {"device": "cpu", "dtype": "float32",
                                               "attention_backend": "cpu"}
    assert (recorded["config"]["device"], recorded["config"]["attention_backend"]) == (
        "auto", "auto")

    def elsewhere(**change: Any) -> JobConfig:
        return dataclasses.replace(config, engine=dataclasses.replace(config.engine, **change))

    summary = run_job(elsewhere(attention_backend="torch"), _factory(tiny_engine),
                      progress=False)
    assert (summary.shards_resumed, summary.shards_run) == (5, 0)  # finished: nothing to run
    (out / "part-00001.parquet").unlink()
    with pytest.raises(JobError) as err:
        run_job(elsewhere(attention_backend="torch"), _factory(tiny_engine), progress=False)
    assert str(err.value).startswith(f"{out} holds the outputs of a different job "
                                     "(placement.attention_backend: 'cpu' -> 'torch'); ")
    summary = run_job(elsewhere(device="cpu", attention_backend="cpu", dtype="float32"),
                      _factory(tiny_engine), progress=False)
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (4, 1, True)
    assert json.loads((out / "manifest.json").read_text())["config"] == recorded["config"]
    for key in ("placement", "device", "attention_backend"):
        del recorded["config"][key]
    (out / "manifest.json").write_text(json.dumps(recorded))
    (out / "part-00002.parquet").unlink()
    summary = run_job(config, _factory(tiny_engine), progress=False)
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (4, 1, True)


def test_a_model_whose_weights_changed_is_refused(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """The same model path with other weights (a checkpoint saved again into its directory): a
    resume would mix two models' outputs in one job without a word; the manifest keeps the
    model's digest (config.json, each weight file's size, first and last MiB) and a rerun whose
    model differs is refused. A manifest written before the digest was kept still resumes."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config, out, before = _finished_job(tmp_path, model, tiny_engine)
    recorded = json.loads((out / "manifest.json").read_text())
    assert len(recorded["config"]["model_digest"]) == 16
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    weights.write_bytes(bytes(data))
    manifest = (out / "manifest.json").read_text()
    with pytest.raises(JobError) as err:
        run_job(config, _factory(tiny_engine), progress=False)
    assert str(err.value).startswith(f"{out} holds the outputs of a different job (model_digest: "
                                     f"{recorded['config']['model_digest']!r} -> '")
    assert str(err.value).endswith("'; the model's config.json or weights are not those the job "
                                   "started with); rerun with --overwrite to discard them, or "
                                   "choose another OUTPUT_DIR")
    assert (out / "manifest.json").read_text() == manifest
    # a manifest of an earlier version, without the digest: resumed as before
    del recorded["config"]["model_digest"]
    (out / "manifest.json").write_text(json.dumps(recorded))
    summary = run_job(config, _factory(tiny_engine), progress=False)
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (5, 0, True)
    assert read_parts(out).equals(before)


def test_changed_input_is_refused(tmp_path: Path, tiny_model_dir: Path,
                                  tiny_engine: Engine) -> None:
    _inputs(tmp_path)
    config = _config(tmp_path, tiny_model_dir)
    run_job(config, _factory(tiny_engine), progress=False)
    # rewritten with its size and modification time kept (`touch -r`): told by its footer
    b = tmp_path / "in" / "b.parquet"
    before = b.stat()
    write_parquet(b, {"id": [f"b{i}" for i in range(3)],
                      "prompt": [p.swapcase() for p in PROMPTS_B], "n": list(range(3))})
    os.utime(b, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (b.stat().st_size, b.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(JobError, match=r"\(.*b.parquet was rewritten \(the same size, other "
                                       r"row groups or column statistics\)\); rerun with "
                                       r"--overwrite"):
        run_job(config, _factory(tiny_engine), progress=False)
    write_parquet(tmp_path / "in" / "b.parquet",
                  {"id": ["b0"], "prompt": ["Berlin is"], "n": [0]})
    with pytest.raises(JobError, match=r"^the input changed since .*out was written \(.*b.parquet "
                                       r"size \d+ -> \d+ bytes\); rerun with --overwrite"):
        run_job(config, _factory(tiny_engine), progress=False)


def test_an_input_copied_or_touched_with_the_same_bytes_resumes(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Its modification time alone changed: the sha256 of its bytes, taken when the job
    started, tells it from a rewrite (before, the only way on was --overwrite, losing every
    committed shard)."""
    _inputs(tmp_path)
    config = _config(tmp_path, tiny_model_dir)
    run_job(config, _factory(tiny_engine), progress=False)
    out = tmp_path / "out"
    parts = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    (out / "part-00001.parquet").unlink()  # one shard to do again
    b = tmp_path / "in" / "b.parquet"
    shutil.copyfile(b, tmp_path / "copy")
    os.replace(tmp_path / "copy", b)  # the same bytes, a new modification time
    capsys.readouterr()
    run_job(config, _factory(tiny_engine), progress=False)
    assert (f"note: {b} has a new modification time but the same bytes (a copy or a touch): "
            "resuming") in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == parts
    recorded = {f["path"]: f["mtime_ns"] for f in json.loads(
        (out / "manifest.json").read_text())["inputs"]}
    assert recorded[str(b)] == b.stat().st_mtime_ns  # no second note next time
    os.utime(b, ns=(b.stat().st_atime_ns, b.stat().st_mtime_ns + 10**9))
    data = bytearray(b.read_bytes())
    data[data.find(b"Berlin")] = ord("M")  # a prompt changed in its page, the footer as it was
    b.write_bytes(bytes(data))
    assert pq.read_table(b).column("prompt")[0].as_py() == "Merlin is"
    with pytest.raises(JobError, match=r"\(.*b.parquet was modified\); rerun with --overwrite"):
        run_job(config, _factory(tiny_engine), progress=False)


def test_stale_temp_files_are_removed_and_part_files_without_manifest_refused(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    _inputs(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".part-00003.parquet.tmp-99999").write_bytes(b"half a file")
    run_job(_config(tmp_path, tiny_model_dir), _factory(tiny_engine), progress=False)
    assert hidden_files(out) == []
    (out / "manifest.json").unlink()
    with pytest.raises(JobError, match=r"out holds _SUCCESS but no manifest.json, so it cannot "
                                       r"be resumed; rerun with --overwrite"):
        run_job(_config(tmp_path, tiny_model_dir), _factory(tiny_engine), progress=False)

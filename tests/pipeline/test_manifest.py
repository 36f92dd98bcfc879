"""manifest.json: round trip, refusal messages, and which files a job owns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import manifest as manifest_module
from pipeline.config import JobConfig, JobError
from pipeline.discover import part_name
from pipeline.manifest import (
    SAVE_SPACING,
    Manifest,
    ManifestWriter,
    check_resumable,
    clear_outputs,
    drop_unusable_parts,
    load_manifest,
    our_files,
)
from pipeline.stats import Counts

INPUTS = [{"path": "/data/a.parquet", "size": 100, "mtime_ns": 5},
          {"path": "/data/b.parquet", "size": 200, "mtime_ns": 6}]


def _manifest(**kw: object) -> Manifest:
    config = JobConfig(input="in", output_dir="out", **kw)  # type: ignore[arg-type]
    return Manifest(config.fingerprint(), [dict(i) for i in INPUTS], 3)


def test_round_trip_with_totals(tmp_path: Path) -> None:
    m = _manifest()
    m.shards[2] = Counts(rows=4, errors=1, completion_tokens=10, wall_seconds=2.0)
    m.shards[0] = Counts(rows=5, completion_tokens=20, wall_seconds=1.0, drafted=6, accepted=3,
                         draft_steps=2, accepted_per_position=[2, 1, 0])
    m.save(str(tmp_path))
    assert os.listdir(tmp_path) == ["manifest.json"]
    loaded = load_manifest(str(tmp_path))
    assert loaded == m and not loaded.complete
    data = m.to_json()
    assert list(data["shards"]) == ["0", "2"]
    assert data["totals"] == {"rows": 9, "errors": 1, "prompt_tokens": 0, "completion_tokens": 30,
                              "wall_seconds": 3.0, "drafted": 6, "accepted": 3, "draft_steps": 2,
                              "accepted_per_position": [2, 1, 0]}


def test_no_manifest_and_damaged_manifest(tmp_path: Path) -> None:
    assert load_manifest(str(tmp_path)) is None
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(JobError, match=r"manifest.json is damaged .*rerun with --overwrite"):
        load_manifest(str(tmp_path))
    for valid_json, kind in (("[]", "an array"), ('"x"', "a string"), ("3", "a number"),
                             ("null", "null")):  # not an object: an AttributeError traceback
        (tmp_path / "manifest.json").write_text(valid_json)
        with pytest.raises(JobError, match=rf"manifest.json is damaged \({kind}, not an "
                                           r"object\); rerun with --overwrite"):
            load_manifest(str(tmp_path))
    # fields of the wrong type: tracebacks in report and resume
    good = _manifest().to_json()
    for change, reason in (
            ({"config": []}, "'config' is an array, not an object"),
            ({"config": {**good["config"], "sampling": "x"}},
             "'sampling' is a string, not an object"),
            ({"shards": []}, "'shards' is an array, not an object"),
            ({"shards": {"0": 3}}, "'shards' holds something other than objects"),
            ({"shards": {"0": {**Counts(rows=2).to_json(), "rows": "9"}}},
             "a shard's 'rows' is not a number"),
            ({"inputs": 5}, "'inputs' is a number, not an array"),
            ({"committed_at": 3}, "'committed_at' is a number, not an object"),
            ({"num_shards": "1"}, "'num_shards' is a string, not a number"),
            ({"num_shards": True}, "'num_shards' is true or false, not a number"),
            ({"runs": {}}, "'runs' is an object, not an array"),
            # found by QA: a report said "8 of 2 shards committed", -8.0 s, nan tokens/s
            ({"shards": {"5": Counts(rows=2).to_json()}},
             f"shard 5 is committed, but the job has shards 0..{good['num_shards'] - 1}"),
            ({"shards": {"-1": Counts(rows=2).to_json()}},
             f"shard -1 is committed, but the job has shards 0..{good['num_shards'] - 1}"),
            ({"shards": {"0": {**Counts(rows=2).to_json(), "wall_seconds": -8.0}}},
             "shard 0's 'wall_seconds' is -8.0"),
            ({"shards": {"0": {**Counts(rows=2).to_json(), "wall_seconds": float("nan")}}},
             "shard 0's 'wall_seconds' is nan")):
        (tmp_path / "manifest.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(JobError) as raised:
            load_manifest(str(tmp_path))
        assert str(raised.value) == (f"{tmp_path / 'manifest.json'} is damaged ({reason}); "
                                     "rerun with --overwrite to start over")
    del good["config"]
    (tmp_path / "manifest.json").write_text(json.dumps(good))
    with pytest.raises(JobError, match=r"is damaged \(no 'config'\)"):
        load_manifest(str(tmp_path))


def test_same_job_and_input_may_resume() -> None:
    m = _manifest()
    check_resumable(m, _manifest().config, [dict(i) for i in INPUTS], "out")


def test_a_different_job_is_refused_naming_what_changed() -> None:
    m = _manifest()
    other = _manifest(temperature=0.7, stop=("\n",)).config
    with pytest.raises(JobError) as err:
        check_resumable(m, other, INPUTS, "out")
    assert str(err.value) == (
        "out holds the outputs of a different job (sampling.stop: [] -> ['\\n']; "
        "sampling.temperature: 0.0 -> 0.7); rerun with --overwrite to discard them, "
        "or choose another OUTPUT_DIR")
    # an option the fingerprint holds only where given (it read "'a_' -> None")
    prefixed = _manifest(output_prefix="a_")
    with pytest.raises(JobError, match=r"\(columns.output_prefix: 'a_' -> not given\)"):
        check_resumable(prefixed, m.config, INPUTS, "out")
    with pytest.raises(JobError, match=r"\(columns.output_prefix: not given -> 'a_'\)"):
        check_resumable(m, prefixed.config, INPUTS, "out")
    # so are the penalties: a job from before they existed stays resumable
    penalized = _manifest(repetition_penalty=1.1)
    with pytest.raises(JobError, match=r"\(sampling.repetition_penalty: not given -> 1.1\)"):
        check_resumable(m, penalized.config, INPUTS, "out")
    assert "repetition_penalty" not in json.dumps(m.config)


@pytest.mark.parametrize(("inputs", "change"), [
    ([INPUTS[0], {**INPUTS[1], "size": 201}], "/data/b.parquet size 200 -> 201 bytes"),
    ([INPUTS[0], {**INPUTS[1], "mtime_ns": 7}], "/data/b.parquet was modified"),

    ([INPUTS[0]], "/data/b.parquet is gone"),
    ([*INPUTS, {"path": "/data/c.parquet", "size": 1, "mtime_ns": 1}], "new file /data/c.parquet"),
])
def test_changed_input_is_refused(inputs: list, change: str) -> None:
    m = _manifest()
    with pytest.raises(JobError) as err:
        check_resumable(m, m.config, inputs, "out")
    assert str(err.value) == (f"the input changed since out was written ({change}); rerun with "
                              f"--overwrite to discard its outputs, or choose another OUTPUT_DIR")


def test_a_file_rewritten_with_its_size_and_mtime_is_refused_by_its_footer() -> None:
    m = _manifest()
    m.inputs = [{**i, "footer": f"f{n}"} for n, i in enumerate(INPUTS)]
    same = [dict(i) for i in m.inputs]
    check_resumable(m, m.config, same, "out")
    with pytest.raises(JobError) as err:
        check_resumable(m, m.config, [same[0], {**same[1], "footer": "other"}], "out")
    assert str(err.value) == (
        "the input changed since out was written (/data/b.parquet was rewritten (the same size, "
        "other row groups or column statistics)); rerun with --overwrite to discard its "
        "outputs, or choose another OUTPUT_DIR")
    # a manifest written before footers were recorded resumes
    check_resumable(_manifest(), m.config, [same[0], {**same[1], "footer": "other"}], "out")


def test_clear_outputs_removes_only_the_job_files(tmp_path: Path) -> None:
    for name in ("part-00000.parquet", "part-00001.parquet", "manifest.json", "stats.parquet",
                 "_SUCCESS", ".part-00002.parquet.tmp-123", "notes.txt", "partial.csv",
                 "part-notes.parquet", "part-001.parquet"):
        (tmp_path / name).write_text("x")
    assert our_files(str(tmp_path)) == [".part-00002.parquet.tmp-123", "_SUCCESS",
                                        "manifest.json", "part-00000.parquet",
                                        "part-00001.parquet", "stats.parquet"]
    clear_outputs(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "part-001.parquet",
                                            "part-notes.parquet", "partial.csv"]


def test_committed_shards_whose_part_file_is_gone_or_damaged_are_forgotten(
        tmp_path: Path) -> None:
    m = _manifest()
    m.shards = {k: Counts(rows=2) for k in range(5)}
    for k in (0, 2, 3, 4):
        pq.write_table(pa.table({"id": ["a", "b", "c"][:3 if k == 3 else 2]}),
                       tmp_path / f"part-0000{k}.parquet")
    damaged = tmp_path / "part-00002.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-20])  # truncated: no footer
    assert drop_unusable_parts(m, str(tmp_path)) == {
        1: "missing",
        2: "unreadable (Parquet magic bytes not found in footer. Either the file is corrupted "
           "or this is not a parquet file.)",
        3: "3 rows where 2 were committed"}
    assert sorted(m.shards) == [0, 4]


def test_a_part_file_whose_bytes_changed_since_its_commit_is_forgotten(tmp_path: Path) -> None:
    """Same rows and a readable footer, but other bytes (a corrupt page, another shard's part
    file moved in its place): the digest committed with it says so."""
    m = _manifest()
    for k, ids in enumerate((["a", "b"], ["c", "d"], ["e", "f"])):
        pq.write_table(pa.table({"id": ids}), tmp_path / f"part-0000{k}.parquet")
        m.commit(k, Counts(rows=2), str(tmp_path))
    (tmp_path / "part-00000.parquet").rename(tmp_path / "swap")
    (tmp_path / "part-00001.parquet").rename(tmp_path / "part-00000.parquet")
    (tmp_path / "swap").rename(tmp_path / "part-00001.parquet")
    saved = tmp_path / "manifest"
    saved.mkdir()
    m.save(str(saved))
    loaded = load_manifest(str(saved))
    assert loaded is not None and loaded.part_digests == m.part_digests
    changed = "changed since it was committed (its bytes differ)"
    assert drop_unusable_parts(loaded, str(tmp_path)) == {0: changed, 1: changed}
    assert sorted(loaded.shards) == [2]
    # a column name that is not UTF-8 in a part file's footer: unreadable, not a traceback
    part = tmp_path / "part-00002.parquet"
    part.write_bytes(part.read_bytes().replace(b"id", b"\xffd"))
    assert drop_unusable_parts(loaded, str(tmp_path))[2].startswith("unreadable (")


def test_commits_are_saved_at_most_as_often_as_keeps_saving_to_a_twentieth(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save writes every committed shard: saved at each commit, a job of many small shards
    was quadratic (1,500 one-row shards: 66 s for 9 s of generation). On a clock where a save
    takes 1 s and a shard 0.5 s, the manifest is saved after shard 0, then once 19 s have
    passed since the save's end; flush() saves the rest."""
    now = [0.0]
    monkeypatch.setattr(manifest_module.time, "monotonic", lambda: now[0])
    saved: list[int] = []
    save = Manifest.save

    def timed_save(self: Manifest, output_dir: str) -> None:
        save(self, output_dir)
        saved.append(len(self.shards))
        now[0] += 1.0
    monkeypatch.setattr(Manifest, "save", timed_save)
    m = Manifest({}, [], 100)
    writer = ManifestWriter(m, str(tmp_path))
    for shard in range(100):
        (tmp_path / part_name(shard)).write_bytes(b"rows")
        writer.commit(shard, Counts(rows=1))
        now[0] += 0.5
    assert SAVE_SPACING == 19
    # saved at 0 (until 1), then at the first commit from 1 + 19 = 20: shard 38's (39 shards,
    # until 21), then from 40: shard 76's
    assert saved == [1, 39, 77]
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"].keys() == {
        str(i) for i in range(77)}
    writer.flush()
    assert saved == [1, 39, 77, 100]
    assert load_manifest(str(tmp_path)).complete  # type: ignore[union-attr]
    writer.flush()  # nothing new: no save
    assert saved == [1, 39, 77, 100]


def test_a_save_that_fails_says_which_shards_are_not_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """On a full disk the job's error said the shards committed so far are kept; those written
    since the last save are not: the note says how many, once."""
    monkeypatch.setattr(manifest_module, "SAVE_SPACING", 1e9)
    m = Manifest({}, [], 10)
    writer = ManifestWriter(m, str(tmp_path))
    for shard in range(3):
        (tmp_path / part_name(shard)).write_bytes(b"rows")
        writer.commit(shard, Counts(rows=1))  # shard 0 saved; 1 and 2 wait

    def full(self: Manifest, output_dir: str) -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "manifest.json"))
    monkeypatch.setattr(Manifest, "save", full)
    with pytest.raises(OSError, match="No space left"):
        writer.flush()
    writer.flush()  # the job stops with the first error: no second try, no second note
    assert capsys.readouterr().err == ("note: 2 shard(s) written since the manifest's last save "
                                       "are not committed; a rerun generates them again\n")
    assert list(load_manifest(str(tmp_path)).shards) == [0]  # type: ignore[union-attr]


def test_a_ray_resume_of_a_local_run_is_told_what_auto_resolved_to(tmp_path: Path) -> None:
    """Ray's workers resolve 'auto' for themselves, so the options are compared as given; the
    refusal said "'auto' -> 'torch'" where the local run had run on the C++ kernels (found by
    QA). It now says what the job ran with."""
    from pipeline.manifest import check_placement  # noqa: PLC0415

    placed = {"device": "auto", "dtype": "float32", "attention_backend": "auto",
              "placement": {"device": "cpu", "dtype": "float32", "attention_backend": "cpu"}}
    manifest = Manifest({**_manifest().config, **placed}, [], 3)
    check_placement(manifest, {k: v for k, v in placed.items() if k != "placement"}, "out")
    with pytest.raises(JobError) as err:
        check_placement(manifest, {"device": "auto", "dtype": "float32",
                                   "attention_backend": "torch"}, "out")
    assert str(err.value) == (
        "out holds the outputs of a different job (attention_backend: 'auto' -> 'torch'; the job "
        "ran with attention_backend 'cpu', device 'cpu', dtype 'float32'); rerun with "
        "--overwrite to discard them, or choose another OUTPUT_DIR")

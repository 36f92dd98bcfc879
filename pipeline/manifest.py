"""OUTPUT_DIR/manifest.json: what job wrote this directory, and which shards are committed.

A shard is committed once its part file has been renamed into place AND the manifest that lists it
has been renamed into place (both atomically). A part file the manifest does not list (a crash
between the two renames) is simply regenerated and replaced on resume.

    {"version": 1, "config": {...JobConfig.fingerprint()}, "inputs": [{path, size, mtime_ns}, ...],
     "num_shards": 50, "shards": {"7": {"rows": 10000, "errors": 2, ...Counts}, ...},
     "totals": {...Counts}, "complete": false,
     "runs": [{"started": 1765000000.0, "runner": "local"}, {..., "runner": "ray", "workers": 4,
               "row_options": ["temperature"]}],
     "committed_at": {"7": 1765000123.456, ...}, "part_digests": {"7": "<sha256>", ...}}

`runs` and `committed_at` are a record, not part of what a resume checks: one entry per run of
the job (the first and every resume), with its start (Unix time), runner and the input columns
that overrode options row by row (if any), and each shard's commit time (Unix time), so a
report can tell the runs apart and draw the job over time.
`part_digests` is what a resume checks each committed part file against: a part file damaged
or replaced since (a flipped byte in a page, two part files swapped) is generated again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.atomic import is_temp_name, write_bytes_atomically
from pipeline.config import JobError, one_line
from pipeline.discover import MANIFEST_FILE, SUCCESS_FILE, is_part_name, part_name
from pipeline.stats import STATS_FILE, Counts, total, write_stats

# what `eaglebatch report` writes into a job's OUTPUT_DIR (pipeline.bench.job_report)
JOB_REPORT_FILE = "report.md"
JOB_REPORT_TITLE = "# eaglebatch job report"  # its first line (a job refreshes such a file)
JOB_PLOTS = {"throughput": "shard_tokens_per_s.png", "acceptance": "acceptance_by_position.png",
             "errors": "errors_by_shard.png"}
LOCK_FILE = ".eaglebatch.lock"
_VERSION = 1


@dataclass
class Manifest:
    config: dict[str, Any]
    inputs: list[dict[str, Any]]
    num_shards: int
    shards: dict[int, Counts] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    # Unix time at which each shard was committed (absent for shards of older manifests)
    committed_at: dict[int, float] = field(default_factory=dict)
    # sha256 of each committed part file (absent for shards of older manifests)
    part_digests: dict[int, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.num_shards

    def commit(self, shard_id: int, counts: Counts, output_dir: str) -> None:
        """Record the shard whose part file is in place in output_dir (save() commits it)."""
        self.shards[shard_id] = counts
        self.committed_at[shard_id] = round(time.time(), 3)
        self.part_digests[shard_id] = file_digest(os.path.join(output_dir, part_name(shard_id)))

    def to_json(self) -> dict[str, Any]:
        return {"version": _VERSION, "config": self.config, "inputs": self.inputs,
                "num_shards": self.num_shards,
                "shards": {str(k): v.to_json() for k, v in sorted(self.shards.items())},
                "totals": total(self.shards.values()).to_json(), "complete": self.complete,
                "runs": self.runs,
                "committed_at": {str(k): self.committed_at[k] for k in sorted(self.shards)
                                 if k in self.committed_at},
                "part_digests": {str(k): self.part_digests[k] for k in sorted(self.shards)
                                 if k in self.part_digests}}

    def save(self, output_dir: str) -> None:
        data = json.dumps(self.to_json(), indent=1, sort_keys=True).encode()
        write_bytes_atomically(os.path.join(output_dir, MANIFEST_FILE), data)


# After a save that took t seconds, the next waits until t * SAVE_SPACING has passed: saving
# then costs at most 1 / (1 + SAVE_SPACING) of a job's time (5%). A save writes every committed
# shard, so saving at every commit made a job of many small shards quadratic (1,500 one-row
# shards: 62 ms a commit by the end, 66 s for 9 s of generation). Shards of a second or more
# are saved one by one as before.
SAVE_SPACING = 19


class ManifestWriter:
    """Commits shards to `manifest` and saves it with stats.parquet, at most as often as
    SAVE_SPACING allows; flush() saves what is left (the job's end, an interrupt). A shard whose
    part file is in place but that a save has not yet listed (a crash in between) is generated
    again on resume, as the module docstring says: a crash loses at most the last ~5% of the
    job's time, never a row."""

    def __init__(self, manifest: Manifest, output_dir: str) -> None:
        self.manifest, self.output_dir = manifest, output_dir
        self._unsaved = 0  # shards committed since the last save
        self._due = 0.0  # time.monotonic() from which a commit saves
        self._failed = False

    def commit(self, shard_id: int, counts: Counts) -> None:
        self.manifest.commit(shard_id, counts, self.output_dir)
        self._unsaved += 1
        if time.monotonic() >= self._due:
            self.flush()

    def flush(self) -> None:
        if not self._unsaved or self._failed:  # (once failed, the job stops with its error)
            return
        start = time.monotonic()
        try:
            self.manifest.save(self.output_dir)
        except OSError:  # a full disk: the shards since the last save are not committed
            self._failed = True
            print(f"note: {self._unsaved} shard(s) written since the manifest's last save "
                  "are not committed; a rerun generates them again", file=sys.stderr)
            raise
        write_stats(self.output_dir, self.manifest.shards, self.manifest.committed_at)
        self._unsaved = 0
        end = time.monotonic()
        self._due = end + (end - start) * SAVE_SPACING


class DamagedManifest(JobError):
    """manifest.json exists but cannot be read."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} is damaged ({reason}); rerun with --overwrite to start over")
        self.path, self.reason = path, reason


def load_manifest(output_dir: str) -> Manifest | None:
    path = os.path.join(output_dir, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise TypeError(f"{_json_kind(data)}, not an object")
        config = _field(data, "config", dict)
        _field(config, "sampling", dict, {})  # a report reads it
        inputs = _field(data, "inputs", list)
        runs = _field(data, "runs", list, [])
        shards = _field(data, "shards", dict)
        for name, items in (("inputs", inputs), ("runs", runs), ("shards", shards.values())):
            if not all(isinstance(item, dict) for item in items):
                raise TypeError(f"'{name}' holds something other than objects")
        committed_at = {int(k): float(v)
                        for k, v in _field(data, "committed_at", dict, {}).items()}
        digests = {int(k): str(v) for k, v in _field(data, "part_digests", dict, {}).items()}
        num_shards = _field(data, "num_shards", int)
        counts = {int(k): Counts.from_json(v) for k, v in shards.items()}
        outside = sorted(k for k in counts if not 0 <= k < num_shards)
        if outside:
            raise ValueError(f"shard {outside[0]} is committed, but the job has shards "
                             f"0..{num_shards - 1}")
        for shard, c in counts.items():
            if (bad := c.impossible()) is not None:
                raise ValueError(f"shard {shard}'s '{bad}' is {getattr(c, bad)}")
        return Manifest(config, inputs, num_shards, counts, runs, committed_at, digests)
    except (ValueError, TypeError) as exc:
        raise DamagedManifest(path, str(exc)) from None


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "true or false", type(None): "null"}
_ABSENT = object()


def _json_kind(value: object) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _field(data: dict[str, Any], key: str, kind: type, default: Any = _ABSENT) -> Any:
    """data[key], which must be of `kind` (a JSON object, array or integer here); `default`
    where it is absent (without one, its absence is an error)."""
    if key not in data:
        if default is _ABSENT:
            raise ValueError(f"no '{key}'")
        return default
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"'{key}' is {_json_kind(value)}, not {_JSON_KINDS[kind]}")
    return value


# Fingerprint fields compared only where both runs recorded them: the model's digest, device and
# attention backend (not recorded before this version: such a job still resumes), and the
# placement the local runner resolves (the Ray runner's workers resolve their own).
_IF_BOTH = ("model_digest", "device", "attention_backend", "placement")
# where the job runs: the options as given, and placement, what the local runner resolved them
# to (compared by check_placement, once it is known that the run generates)
PLACED = ("device", "dtype", "attention_backend", "placement")


def check_resumable(manifest: Manifest, config: dict[str, Any], inputs: list[dict[str, Any]],
                    output_dir: str) -> None:
    """Refuse to resume a directory written by a different job or from different input (where
    it runs aside: check_placement)."""
    _refuse_differences(*_compared(manifest.config, config, exclude=PLACED), output_dir)
    change, touched = _input_change(manifest.inputs, inputs)
    if change:
        raise JobError(f"the input changed since {output_dir} was written ({change}); rerun with "
                       f"--overwrite to discard its outputs, or choose another OUTPUT_DIR")
    for path in touched:
        print(f"note: {path} has a new modification time but the same bytes (a copy or a "
              "touch): resuming", file=sys.stderr)
    # the manifest records the files as they are now (each keeps the digest of its bytes)
    digests = {f["path"]: f.get("sha256") for f in manifest.inputs}
    manifest.inputs = [f | ({"sha256": digests[f["path"]]} if digests.get(f["path"]) else {})
                       for f in inputs]


def check_placement(manifest: Manifest, config: dict[str, Any], output_dir: str) -> None:
    """Refuse to generate more of a job elsewhere than it ran (the attention backends sum in
    other orders, a GPU job ran in bfloat16): placement where both runs kept it (the local
    runner), else the options as given."""
    old, new = _compared({k: v for k, v in manifest.config.items() if k in PLACED},
                         {k: v for k, v in config.items() if k in PLACED}, exclude=())
    if "placement" in old and "placement" in new:  # the options' spelling aside
        old, new = {"placement": old["placement"]}, {"placement": new["placement"]}
    resolved = manifest.config.get("placement")
    ran = ""
    if "placement" not in old and isinstance(resolved, dict):  # a local run, then a Ray one
        ran = "; the job ran with " + ", ".join(f"{k} {v!r}" for k, v in sorted(resolved.items()))
    _refuse_differences(old, new, output_dir, ran)


def _compared(old: dict[str, Any], new: dict[str, Any], exclude: tuple[str, ...]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two fingerprints without `exclude`, and without the fields of _IF_BOTH that one of
    them lacks."""
    def keep(key: str, other: dict[str, Any]) -> bool:
        return key not in exclude and (key not in _IF_BOTH or key in other)

    return ({k: v for k, v in old.items() if keep(k, new)},
            {k: v for k, v in new.items() if keep(k, old)})


def _refuse_differences(old: dict[str, Any], new: dict[str, Any], output_dir: str,
                        why: str = "") -> None:
    """why: said after the differences."""
    diffs = _differences(old, new)
    if diffs:
        if any(d.startswith("model_digest:") for d in diffs):
            why += "; the model's config.json or weights are not those the job started with"
        raise JobError(f"{output_dir} holds the outputs of a different job ({'; '.join(diffs)}"
                       f"{why}); rerun with --overwrite to discard them, or choose another "
                       "OUTPUT_DIR")


def has_our_outputs(output_dir: str) -> bool:
    return bool(our_files(output_dir))


def our_files(output_dir: str) -> list[str]:
    """The names in output_dir that a job writes (never the user's other files)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir)
                  if n in (MANIFEST_FILE, STATS_FILE, SUCCESS_FILE) or is_temp_name(n)
                  or is_part_name(n))


def clear_outputs(output_dir: str) -> None:
    """Removes the job's files (--overwrite), and the report of them `eaglebatch report` wrote
    there, if any (it would describe discarded outputs)."""
    report = ([JOB_REPORT_FILE, *JOB_PLOTS.values()]
              if os.path.exists(os.path.join(output_dir, MANIFEST_FILE)) else [])
    for name in our_files(output_dir) + report:
        if os.path.exists(path := os.path.join(output_dir, name)):
            os.remove(path)


def drop_unusable_parts(manifest: Manifest, output_dir: str,
                        unusable: dict[int, str] | None = None) -> dict[int, str]:
    """Forget committed shards whose part file was deleted or damaged since (its bytes not the
    ones committed, where the manifest has their digest; else its Parquet footer unreadable or
    its row count not the one committed), so they are generated again; returns {shard id: what
    is wrong with its part file}. Reads every committed part file once (a hash of its bytes),
    unless given what unusable_parts found."""
    if unusable is None:
        unusable = unusable_parts(manifest, output_dir)
    for k in unusable:
        del manifest.shards[k]
    return unusable


MISSING = "missing"  # unusable_parts' word for a part file that is not there


def unusable_parts(manifest: Manifest, output_dir: str) -> dict[int, str]:
    """What drop_unusable_parts would drop, the manifest left as it is."""
    unusable = {}
    for k, counts in manifest.shards.items():
        path = os.path.join(output_dir, part_name(k))
        if not os.path.exists(path):
            unusable[k] = MISSING
            continue
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException, ValueError) as exc:  # ValueError: a name not UTF-8
            unusable[k] = f"unreadable ({one_line(exc)})"
            continue
        if rows != counts.rows:
            unusable[k] = f"{rows} rows where {counts.rows} were committed"
        elif k in manifest.part_digests and file_digest(path) != manifest.part_digests[k]:
            unusable[k] = "changed since it was committed (its bytes differ)"
    return unusable


def file_digest(path: str) -> str:
    """sha256 of the file's bytes (hex)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """['sampling.temperature: 0.0 -> 0.7', ...] for every leaf that differs."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {_shown(old, key)} -> {_shown(new, key)}")
    return diffs


def _shown(config: dict[str, Any], key: str) -> str:
    """An option's value in a difference; 'not given' for one a job's fingerprint leaves out
    unless given (--output-prefix)."""
    return repr(config[key]) if key in config else "not given"


def with_input_digests(inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input fingerprints of a new job, each with the sha256 of its file's bytes: a file
    whose modification time alone changes later (copied again, touched) is then told from one
    rewritten, so that the job can still resume. One read of every input, at the job's start."""
    return [f | {"sha256": file_digest(f["path"])} for f in inputs]


def _partition_text(partitions: list[list[str | None]] | None) -> str:
    if not partitions:
        return "no partition columns"
    return "partition columns " + ", ".join(f"{key}={value}" for key, value in partitions)


def _input_change(old: list[dict[str, Any]], new: list[dict[str, Any]]
                  ) -> tuple[str | None, list[str]]:
    """(how the input changed, or None; the files whose modification time alone changed, their
    bytes the same)."""
    old_by_path = {f["path"]: f for f in old}
    new_by_path = {f["path"]: f for f in new}
    added = sorted(new_by_path.keys() - old_by_path.keys())
    if added:
        return f"new file {added[0]}", []
    gone = sorted(old_by_path.keys() - new_by_path.keys())
    if gone:
        return f"{gone[0]} is gone", []
    touched = []
    for path, f in new_by_path.items():
        before = old_by_path[path]
        if before["size"] != f["size"]:
            return f"{path} size {before['size']} -> {f['size']} bytes", []
        if before.get("partitions", []) != f.get("partitions", []):
            was, now = (_partition_text(x.get("partitions")) for x in (before, f))
            return (f"{path} was read with {was}, now with {now} (a directory INPUT reads "
                    f"partition folders' values, a glob does not)"), []
        if before.get("ids") != f.get("ids"):  # a glob over files of one name, spelled again
            was, now = (repr(x["ids"]) if x.get("ids") else "its file name"
                        for x in (before, f))
            return (f"{path}: ids made for its rows would start with {now}, not {was} (the "
                    f"glob is spelled otherwise: give it as before)"), []
        footers = before.get("footer"), f.get("footer")  # manifests before 2026-12-06: none
        if all(footers) and footers[0] != footers[1]:
            return (f"{path} was rewritten (the same size, other row groups or column "
                    "statistics)"), []
        if before["mtime_ns"] != f["mtime_ns"]:
            if not before.get("sha256") or file_digest(path) != before["sha256"]:
                return f"{path} was modified", []
            touched.append(path)
    return None, touched

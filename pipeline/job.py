"""run_job: every pending shard of the input, run by one engine here (the local runner) or by one
engine per Ray worker (pipeline.ray_runner), committed one by one by this process.

Order matters: everything that can refuse the job (inputs, the output directory, the model) is
checked before OUTPUT_DIR is changed or anything is generated.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import NamedTuple

from pipeline.atomic import remove_stale_temps, write_bytes_atomically
from pipeline.bench.metrics import BENCH_FILE
from pipeline.config import JobConfig, JobError, one_line
from pipeline.interrupt import StopFlag, rerun_hint, stop_on_signals
from pipeline.job_engine import build_engine, shard_context
from pipeline.manifest import (
    JOB_REPORT_FILE,
    JOB_REPORT_TITLE,
    LOCK_FILE,
    SUCCESS_FILE,
    Manifest,
    ManifestWriter,
    check_placement,
    check_resumable,
    clear_outputs,
    drop_unusable_parts,
    load_manifest,
    our_files,
    unusable_parts,
    with_input_digests,
)
from pipeline.progress import Progress
from pipeline.schema import OVERRIDE_COLUMNS
from pipeline.shard import ShardHooks, run_shard
from pipeline.sources import (
    InputFile,
    InputPlan,
    Shard,
    open_inputs,
    part_name,
    plan_shards,
    scan_inputs,
)
from pipeline.stages.generate import EngineLike
from pipeline.stats import Counts, busy_seconds, shard_spans, summary_line, total, write_stats
from runtime.config import EngineConfig, PlacementError
from runtime.engine import Engine
from runtime.setup import place


class JobSummary(NamedTuple):
    totals: Counts  # over every committed shard, this run and earlier ones
    shards_total: int
    shards_resumed: int  # committed before this run
    shards_run: int
    complete: bool  # _SUCCESS written
    seconds: float | None = None  # earlier runs' shard seconds + this run's elapsed generation

    @property
    def line(self) -> str:
        seconds = self.totals.wall_seconds if self.seconds is None else self.seconds
        return summary_line(self.totals, seconds)


# Runs shards and yields (shard id, counts) as each part file lands in OUTPUT_DIR; the caller
# commits each to the manifest before asking for the next.
RunShards = Callable[[list[Shard], ShardHooks], Iterator[tuple[int, Counts]]]
Runner = Callable[[JobConfig, InputPlan, Callable[[EngineConfig], EngineLike]],
                  AbstractContextManager[RunShards]]


def run_job(config: JobConfig, engine_factory: Callable[[EngineConfig], EngineLike] = Engine,
            progress: bool = True) -> JobSummary:
    runner = _runner(config)
    files, schema, has_id = open_inputs(config)
    _check_output_dir(config.output_dir, config.input, files)
    if overrides := [name for name in OVERRIDE_COLUMNS if name in schema.names]:
        # said, as they may come from an earlier job's input (a job reading its outputs)
        print(f"note: input column(s) {', '.join(overrides)} override the job's options row by "
              "row where they are not null (rename them to apply the options to every row)",
              file=sys.stderr)
    files = scan_inputs(files, config, has_id)
    plan = InputPlan(files, schema, has_id, plan_shards(files, config.shard_rows))
    created = _missing_folders(config.output_dir)  # OUTPUT_DIR first, then its new parents
    try:
        os.makedirs(config.output_dir, exist_ok=True)
    except OSError as exc:
        raise JobError(f"cannot create OUTPUT_DIR {config.output_dir} ({_reason(exc)})") from None
    with _locked(config.output_dir), _naming_write_errors(config.overwrite):
        try:
            summary = _run_locked(config, plan, runner, engine_factory, progress)
            if summary.shards_run:
                _refresh_report(config.output_dir)
        except BaseException:
            # refused before it wrote anything (the model would not load, say): leave no trace.
            # Only the lock's holder tidies up: a job refused for the lock must not remove the
            # directory (and lock file) of the job that holds it.
            if created and os.listdir(config.output_dir) == [LOCK_FILE]:
                os.remove(os.path.join(config.output_dir, LOCK_FILE))
                for folder in created:  # the ones makedirs made, if still empty
                    try:
                        os.rmdir(folder)
                    except OSError:
                        break
            raise
    print(summary.line)
    return summary


def _refresh_report(output_dir: str) -> None:
    """A report.md that `eaglebatch report` wrote into OUTPUT_DIR describes the job as it was:
    written again from the files as they are now (a failure to is said, not raised: the job's
    rows are committed)."""
    try:
        with open(os.path.join(output_dir, JOB_REPORT_FILE), encoding="utf-8") as f:
            ours = f.readline().rstrip("\n") == JOB_REPORT_TITLE
    except (OSError, UnicodeDecodeError):
        return
    if not ours:  # the user's own report.md
        return
    from pipeline.bench.job_report import write_job_report  # noqa: PLC0415 (matplotlib)

    try:
        write_job_report(output_dir, output_dir)
    except Exception as exc:  # noqa: BLE001  (the rows are committed: never fail the job here)
        print(f"note: {os.path.join(output_dir, JOB_REPORT_FILE)} describes the job before "
              f"this run and could not be written again ({exc}): rerun eaglebatch report",
              file=sys.stderr)
    else:
        print(f"wrote {os.path.join(output_dir, JOB_REPORT_FILE)} again (it was there)",
              file=sys.stderr)


def _missing_folders(path: str) -> list[str]:
    """The folders of `path` that do not exist yet, deepest first (makedirs will make them)."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _run_locked(config: JobConfig, plan: InputPlan, runner: Runner,
                engine_factory: Callable[[EngineConfig], EngineLike],
                progress: bool) -> JobSummary:
    """The job's shards, in OUTPUT_DIR locked for it."""
    manifest = _manifest_for(config, plan)
    unusable = unusable_parts(manifest, config.output_dir)  # read once: each part file's hash
    if not config.overwrite and manifest.complete and not unusable:
        runner = _nothing_to_run  # a rerun of a finished job: no model to load, no cluster
    else:  # it generates: where it runs is where the job ran (a new job's manifest: trivially)
        check_placement(manifest, config.placement_options() | _placement(config),
                        config.output_dir)
    with runner(config, plan, engine_factory) as run_shards:
        resumed = _prepare_output_dir(config, manifest, unusable,
                                      [n for n in OVERRIDE_COLUMNS if n in plan.schema.names])
        seconds_before = _seconds_before(manifest)
        pending = [s for s in plan.shards if s.shard_id not in manifest.shards]
        bar = Progress(sum(s.num_rows for s in plan.shards),
                       sum(s.num_rows for s in plan.shards if s.shard_id in manifest.shards),
                       enabled=progress)
        start = time.monotonic()
        writer = ManifestWriter(manifest, config.output_dir)
        try:
            with stop_on_signals(config.overwrite) as stop:
                hooks = ShardHooks(bar.rows_done, _on_step(bar, stop), stop.check)
                try:
                    for shard_id, counts in run_shards(pending, hooks):
                        writer.commit(shard_id, counts)
                finally:  # on an interrupt or error too, with the job's own signal handlers
                    with stop.shielded():
                        writer.flush()
        finally:
            bar.close()
        elapsed = time.monotonic() - start
    if manifest.complete:
        write_bytes_atomically(os.path.join(config.output_dir, SUCCESS_FILE), b"")
    return JobSummary(total(manifest.shards.values()), manifest.num_shards, resumed,
                      len(pending), manifest.complete,
                      None if config.ray is None else seconds_before + elapsed)


def _seconds_before(manifest: Manifest) -> float:
    """The time in which the earlier runs' shards were generating: their seconds summed
    overlapped where parallel workers ran them (the report's reckoning, from commit times),
    and are summed only where some commit time is unknown."""
    spans = shard_spans(manifest.shards, {s: manifest.committed_at.get(s) for s in manifest.shards})
    if spans is None:
        return total(manifest.shards.values()).wall_seconds
    return busy_seconds(list(spans.values()))


def _check_output_dir(output_dir: str, input_spec: str, files: list[InputFile]) -> None:
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise JobError(f"OUTPUT_DIR {output_dir} is a file, not a directory")
    real = os.path.realpath(output_dir)
    inside = [f.path for f in files if os.path.dirname(os.path.realpath(f.path)) == real]
    if inside:
        raise JobError(f"OUTPUT_DIR {output_dir} holds the input file {inside[0]}; the job writes "
                       f"and deletes part files there (and a rerun would read them as input): "
                       f"choose another OUTPUT_DIR")
    if os.path.isfile(os.path.join(output_dir, BENCH_FILE)):
        raise JobError(f"OUTPUT_DIR {output_dir} holds a bench's {BENCH_FILE}: the job's "
                       f"report would replace the bench's report.md; choose another OUTPUT_DIR")
    if os.path.isdir(input_spec) and os.path.realpath(input_spec) == real:
        raise JobError(f"OUTPUT_DIR {output_dir} is the INPUT directory; the job's part files "
                       f"would sit beside its partition folders (and a rerun would read them as "
                       f"input): choose another OUTPUT_DIR, such as a folder inside it")


@contextmanager
def _naming_write_errors(overwrite: bool) -> Iterator[None]:
    """A file that cannot be written (a full disk, a read-only mount) stops the job with a
    message naming it; the shards committed before are kept."""
    try:
        yield
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise JobError(f"{where}{_reason(exc)}; the shards committed so far are kept: "
                       f"{rerun_hint(overwrite)}") from None


def _reason(exc: OSError) -> str:
    return exc.strerror or one_line(exc)


def _runner(config: JobConfig) -> Runner:
    if config.ray is None:
        return _local_runner
    try:
        from pipeline.ray_runner import ray_runner
    except ImportError as exc:
        raise JobError(f"--runner ray needs Ray, which cannot be imported ({exc}); install it "
                       f"with: pip install 'eaglebatch[ray]'") from None
    return ray_runner


@contextmanager
def _local_runner(config: JobConfig, plan: InputPlan,
                  engine_factory: Callable[[EngineConfig], EngineLike]) -> Iterator[RunShards]:
    """One engine in this process; shards one after another, in order."""
    engine = build_engine(engine_factory, config.engine)
    ctx = shard_context(config, plan.has_id_column, engine)

    def run_shards(pending: list[Shard], hooks: ShardHooks) -> Iterator[tuple[int, Counts]]:
        for shard in pending:
            hooks.check_stop()
            yield shard.shard_id, run_shard(shard, ctx, hooks)

    yield run_shards


@contextmanager
def _nothing_to_run(config: JobConfig, plan: InputPlan,
                    engine_factory: Callable[[EngineConfig], EngineLike]) -> Iterator[RunShards]:
    """The runner of a job whose every shard is committed and intact."""
    def run_shards(pending: list[Shard], hooks: ShardHooks) -> Iterator[tuple[int, Counts]]:
        assert not pending, "a finished job has no shard to run"
        yield from ()

    yield run_shards


def _manifest_for(config: JobConfig, plan: InputPlan) -> Manifest:
    """The manifest this run continues (read only: refusals happen before anything changes)."""
    fresh = Manifest(config.fingerprint(), [f.fingerprint() for f in plan.files],
                     len(plan.shards))
    if config.overwrite:
        fresh.config |= _placement(config)
        fresh.inputs = with_input_digests(fresh.inputs)
        return fresh
    existing = load_manifest(config.output_dir)
    if existing is None:
        fresh.config |= _placement(config)
        leftovers = [n for n in our_files(config.output_dir) if not n.startswith(".")]
        if leftovers:
            raise JobError(f"{config.output_dir} holds {leftovers[0]} but no manifest.json, so it "
                           f"cannot be resumed; rerun with --overwrite to discard it")
        fresh.inputs = with_input_digests(fresh.inputs)
        return fresh
    fresh.config = _context_as_recorded(existing.config, fresh.config, config.engine.model)
    check_resumable(existing, fresh.config, fresh.inputs, config.output_dir)
    return existing


def _placement(config: JobConfig) -> dict[str, object]:
    """Where the local runner's engine runs, 'auto' resolved as on this machine: a job started on
    the CPU kernels is not finished on torch's attention, nor one started on a GPU in bfloat16
    on the CPU in float32. (The Ray runner's workers resolve 'auto' for themselves.)"""
    if config.ray is not None:
        return {}
    try:
        p = place(config.engine)
    except PlacementError as exc:
        raise JobError(str(exc)) from None
    return {"placement": {"device": p.device.type, "dtype": str(p.dtype).removeprefix("torch."),
                          "attention_backend": p.backend}}


def _context_as_recorded(old: dict[str, object], new: dict[str, object],
                         model: str) -> dict[str, object]:
    """new, with max_model_len as the manifest has it where the two runs differ only in
    spelling: one gave --max-model-len equal to the model's context and the other left it out
    (a manifest records the option; left out, it means the model's context)."""
    given = {old.get("max_model_len"), new.get("max_model_len")}
    if len(given) != 2 or None not in given:
        return new
    from runtime.loader import load_model_config, resolve_model  # noqa: PLC0415 (torch)
    from runtime.rope import context_length  # noqa: PLC0415

    try:
        context = context_length(load_model_config(resolve_model(model)))
    except (OSError, ValueError):  # building the engine says what is wrong with the model
        return new
    return new | {"max_model_len": old.get("max_model_len")} if context in given else new


def _prepare_output_dir(config: JobConfig, manifest: Manifest, unusable: dict[int, str],
                        row_options: list[str]) -> int:
    """Clear (--overwrite) or tidy OUTPUT_DIR, say whether we resume; return shards done.
    row_options: the input's columns that override options row by row, recorded with the run
    for the report."""
    if config.overwrite:
        clear_outputs(config.output_dir)
    remove_stale_temps(config.output_dir)
    for shard_id, problem in drop_unusable_parts(manifest, config.output_dir, unusable).items():
        print(f"{part_name(shard_id)} of committed shard {shard_id} is {problem}; generating "
              "it again", file=sys.stderr)
    if manifest.shards:
        print(f"resuming: {len(manifest.shards)} of {manifest.num_shards} shards done",
              file=sys.stderr)
    if not manifest.complete:  # a rerun of a finished job generates nothing: not a run
        run: dict[str, object] = {"started": round(time.time(), 3), "runner": "local"}
        if config.ray is not None:
            run |= {"runner": "ray", "workers": config.ray.num_workers}
        if row_options:
            run["row_options"] = row_options
        manifest.runs.append(run)
    manifest.save(config.output_dir)
    write_stats(config.output_dir, manifest.shards, manifest.committed_at)
    success = os.path.join(config.output_dir, SUCCESS_FILE)
    if not manifest.complete and os.path.exists(success):
        os.remove(success)
    return len(manifest.shards)


@contextmanager
def _locked(output_dir: str) -> Iterator[None]:
    """One job per OUTPUT_DIR at a time (a second one would delete the first one's temp files)."""
    try:
        lock = open(os.path.join(output_dir, LOCK_FILE), "a")  # noqa: SIM115
    except OSError as exc:
        raise JobError(f"cannot write to OUTPUT_DIR {output_dir} ({_reason(exc)})") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(f"another eaglebatch job is writing to {output_dir}") from None
        yield


def _on_step(bar: Progress, stop: StopFlag) -> Callable[[int], None]:
    def on_step(tokens: int) -> None:
        bar.tokens_generated(tokens)
        stop.check()

    return on_step

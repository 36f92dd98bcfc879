"""run_job on Ray: a local Ray instance (num_cpus=2) started and shut down by this module, the real
tiny engine in every worker. Two workers write exactly what the local runner writes; a worker
killed mid-shard loses only that shard; a job resumes across runners both ways."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.exceptions")  # (a bare "ray" would find tests/pipeline/ray here)

import ray  # noqa: E402

from pipeline.config import JobError  # noqa: E402
from pipeline.interrupt import JobInterrupted  # noqa: E402
from pipeline.job import run_job  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from tests.pipeline.helpers import hidden_files, read_parts  # noqa: E402
from tests.pipeline.ray import ray_helpers  # noqa: E402
from tests.pipeline.ray.ray_helpers import (  # noqa: E402
    IDS,
    KillOnce,
    LoggedEngines,
    SigintDriverAt,
    job_config,
    parts,
    ray_processes,
    stats_without_timing,
    wait_until_gone,
    write_inputs,
)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """Ray for this module's tests; afterwards, every process it started has exited."""
    before = ray_processes()
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    ray.cloudpickle.register_pickle_by_value(ray_helpers)  # workers need not import tests/
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(ray_helpers)
        ray.shutdown()
    assert wait_until_gone(ray_processes() - before) == set()


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_thread_module: None) -> None:
    """Local runs on one torch thread, like a Ray worker that has one CPU (same float sums)."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("ray-inputs"))


@pytest.fixture(scope="module")
def reference(inputs: Path, tiny_model_dir: Path, tiny_engine: Engine,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The local runner's output."""
    out = tmp_path_factory.mktemp("ray-reference") / "out"
    run_job(job_config(inputs, out, tiny_model_dir, workers=None), lambda c: tiny_engine,
            progress=False)
    return out


def _committed(out: Path) -> list[int]:
    return sorted(int(k) for k in json.loads((out / "manifest.json").read_text())["shards"])


def _assert_same_output(out: Path, reference: Path) -> None:
    assert read_parts(out).column("id").to_pylist() == IDS  # every id once, in input order
    expected = parts(reference)
    got = parts(out)
    assert list(got) == list(expected) == [f"part-0000{k}.parquet" for k in range(5)]
    for name, table in expected.items():
        assert got[name].equals(table), name
    assert stats_without_timing(out) == stats_without_timing(reference)
    assert (out / "_SUCCESS").exists() and hidden_files(out) == []


def test_two_workers_write_what_the_local_runner_writes(
        local_ray: None, inputs: Path, reference: Path, tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    engines = LoggedEngines(tmp_path / "engines.log")
    out = tmp_path / "out"
    summary = run_job(job_config(inputs, out, tiny_model_dir), engines, progress=False)
    _assert_same_output(out, reference)
    manifest = json.loads((out / "manifest.json").read_text())
    expected = json.loads((reference / "manifest.json").read_text())
    for counts in [*manifest["shards"].values(), *expected["shards"].values(),
                   manifest["totals"], expected["totals"]]:
        counts.pop("wall_seconds")
    runs, local_runs = manifest.pop("runs"), expected.pop("runs")
    # commit times differ; the part files' digests are equal: the same bytes
    assert manifest.pop("committed_at").keys() == expected.pop("committed_at").keys()
    assert [{k: v for k, v in r.items() if k != "started"} for r in runs + local_runs] == [
        {"runner": "ray", "workers": 2}, {"runner": "local"}]
    # the local runner also keeps where its engine ran ('auto' resolved); the workers resolve
    # their own, and placement is compared only where both runs kept it
    assert expected["config"].pop("placement")["attention_backend"] == "cpu"
    assert manifest == expected  # same config fingerprint: resumable by either runner
    pids = engines.pids()
    assert len(pids) == len(set(pids)) == 2  # one engine per worker, loaded once
    assert (summary.shards_total, summary.shards_resumed, summary.shards_run,
            summary.complete) == (5, 0, 5, True)
    captured = capsys.readouterr()
    assert captured.out.startswith("done: 8 rows (1 error), ")
    assert "ray: 2 workers (1 CPU, 0 GPUs each)" in captured.err
    assert wait_until_gone(pids) == set()  # the job stops its workers


def test_ray_workers_apply_the_sampling_options_as_the_local_runner(
        local_ray: None, inputs: Path, tiny_model_dir: Path, tiny_engine: Engine,
        tmp_path: Path) -> None:
    """Penalties, min_p, min_tokens, logit_bias and logprobs reach the workers: their part files
    are the local runner's, completion_logprobs, completion_top_logprobs and prompt_logprobs
    included."""
    options: dict[str, Any] = dict(temperature=0.9, seed=5, min_p=0.05, min_tokens=3,
                                   repetition_penalty=1.2, frequency_penalty=0.3, logprobs=True,
                                   top_logprobs=2, prompt_logprobs=True, ignore_eos=True,
                                   stop_token_ids=(7, 9), stop=("a",),
                                   include_stop_str_in_output=True,
                                   logit_bias=((12, -50.0), (40, 2.0)))
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    run_job(job_config(inputs, local, tiny_model_dir, workers=None, **options),
            lambda c: tiny_engine, progress=False)
    run_job(job_config(inputs, on_ray, tiny_model_dir, workers=1, **options),
            LoggedEngines(tmp_path / "engines.log"), progress=False)
    expected, got = parts(local), parts(on_ray)
    assert list(got) == list(expected)
    for name, table in expected.items():
        assert got[name].equals(table), name
    rows = read_parts(on_ray).to_pylist()
    logprobs = [r["completion_logprobs"] for r in rows]
    assert sum(lp is not None and len(lp) == r["completion_tokens"] > 0
               for lp, r in zip(logprobs, rows, strict=True)) == len(IDS) - 1  # 1 error
    # the stop string "a" ended some rows, kept at the end of their text
    assert any(r["finish_reason"] == "stop" and r["completion"].endswith("a") for r in rows)
    top = read_parts(on_ray).column("completion_top_logprobs").to_pylist()
    assert [None if t is None else len(t) for t in top] == [
        None if lp is None else len(lp) for lp in logprobs]
    assert {len(entries) for t in top if t is not None for entries in t} == {2}
    scored = read_parts(on_ray).select(["prompt_tokens", "prompt_logprobs"]).to_pylist()
    assert sum(r["prompt_logprobs"] is not None and len(r["prompt_logprobs"])
               == r["prompt_tokens"] > 1 for r in scored) == len(IDS) - 1


def test_a_worker_killed_mid_shard_loses_only_that_shard(
        local_ray: None, inputs: Path, reference: Path, tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    engines = KillOnce(tmp_path / "engines.log", tmp_path / "killed", "The sky is blue")
    out = tmp_path / "out"
    scratch = os.path.join(tempfile.gettempdir(), "eaglebatch-shard-*")
    scratch_before = set(glob.glob(scratch))
    summary = run_job(job_config(inputs, out, tiny_model_dir), engines, progress=False)
    left = set(glob.glob(scratch)) - scratch_before
    assert len(left) <= 1  # the killed worker's scratch directory, nothing else
    for path in left:
        shutil.rmtree(path)
    assert (tmp_path / "killed").exists()
    _assert_same_output(out, reference)
    assert summary.complete and _committed(out) == [0, 1, 2, 3, 4]
    pids = engines.pids()
    # Two workers, then one to replace the dead one (killed at the end if still loading, maybe
    # before it logged its engine).
    assert len(pids) in (2, 3) and len(set(pids)) == len(pids)
    err = capsys.readouterr().err
    assert "ray: a worker died with shard 2 in flight" in err
    assert "ray: 1 worker lost and replaced; its shard was redone" in err
    assert wait_until_gone(pids) == set()


def test_a_job_resumes_across_runners_both_ways(
        local_ray: None, inputs: Path, reference: Path, tiny_model_dir: Path,
        tiny_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One Ray worker is enough here (two are tested above) and starts faster.
    # Started locally, interrupted (SIGINT) while shard 1 generates, finished on Ray.
    out = tmp_path / "local-then-ray"
    with pytest.raises(JobInterrupted):
        run_job(job_config(inputs, out, tiny_model_dir, workers=None),
                SigintDriverAt(tmp_path / "e1.log", tmp_path / "m1", "To bake bread"),
                progress=False)
    assert _committed(out) == [0]
    capsys.readouterr()
    summary = run_job(job_config(inputs, out, tiny_model_dir, workers=1),
                      LoggedEngines(tmp_path / "e2.log"), progress=False)
    assert "resuming: 1 of 5 shards done" in capsys.readouterr().err
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (1, 4, True)
    _assert_same_output(out, reference)

    # Started on Ray, interrupted by a worker that SIGINTs the driver during shard 2, finished
    # by the local runner.
    out = tmp_path / "ray-then-local"
    ray_engines = SigintDriverAt(tmp_path / "e3.log", tmp_path / "m3", "The sky is blue")
    with pytest.raises(JobInterrupted):
        run_job(job_config(inputs, out, tiny_model_dir, workers=1), ray_engines, progress=False)
    done = _committed(out)
    assert done == [0, 1] and hidden_files(out) == []
    assert wait_until_gone(ray_engines.pids()) == set()
    summary = run_job(job_config(inputs, out, tiny_model_dir, workers=None),
                      lambda c: tiny_engine, progress=False)
    assert (summary.shards_resumed, summary.complete) == (len(done), True)
    _assert_same_output(out, reference)


def test_a_model_the_workers_cannot_load_is_refused_before_anything_is_written(
        local_ray: None, inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = job_config(inputs, out, tmp_path / "no-such-model", workers=1)
    with pytest.raises(JobError, match=r"^cannot load --model .*no-such-model: "):
        run_job(config, progress=False)
    assert not out.exists()  # the job made it, and took it back


def test_malformed_ray_addresses_are_named_before_ray_sees_them() -> None:
    from pipeline.ray_runner import _check_reachable  # noqa: PLC0415

    for address in (":6379", "bogus", "head:port"):
        with pytest.raises(JobError, match=f"^--ray-address '{address}': expected HOST:PORT, "
                                           "auto, or ray://HOST:PORT$"):
            _check_reachable(address)
    for address in ("auto", "local", "ray://head:10001"):
        _check_reachable(address)  # Ray's own forms pass through


def test_the_jobs_signal_handlers_outlive_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by QA: ray.init puts in a SIGTERM handler of its own (sys.exit(signum)), so a
    SIGTERM while the workers started ended the job with status 15 and no word. The job's
    handlers are put back when ray.init returns, and a SIGTERM that Ray's took while it ran is
    the job's interrupt (exit 143 in the CLI). (ray.init stands in here for the part that
    matters: which handler it leaves; a real SIGTERM at start-up was checked by hand.)"""
    import signal  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from pipeline.config import RayConfig  # noqa: PLC0415
    from pipeline.ray_runner import _connected  # noqa: PLC0415

    def rays_handler(signum: int, frame: object) -> None:
        sys.exit(signum)

    def init(term: bool) -> Any:
        def fake(**kwargs: object) -> None:
            signal.signal(signal.SIGTERM, rays_handler)
            if term:
                os.kill(os.getpid(), signal.SIGTERM)
        return fake

    def ours(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, ours) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        monkeypatch.setattr(ray, "is_initialized", lambda: False)  # (this module's Ray runs)
        monkeypatch.setattr(ray, "shutdown", lambda: None)
        monkeypatch.setattr(ray, "init", init(term=False))
        with _connected(RayConfig()):
            assert signal.getsignal(signal.SIGTERM) is ours
        monkeypatch.setattr(ray, "init", init(term=True))
        with pytest.raises(JobInterrupted) as err, _connected(RayConfig(), overwrite=True):
            pass
        assert err.value.signum == signal.SIGTERM
        assert str(err.value) == ("interrupted; rerun the same command without --overwrite to "
                                  "resume (with it, the job starts over)")
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

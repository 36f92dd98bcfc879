"""`--runner ray`: the job's shards on a pool of Ray actors, one engine per actor.

The driver (run_job, in this process) keeps everything that makes a job exactly-once: the lock on
OUTPUT_DIR, the manifest and the part files. A worker builds its engine once, runs a shard through
the same run_shard as the local runner into a scratch directory of its own, and returns the part
file's bytes; the driver renames them into OUTPUT_DIR and only then records the shard in the
manifest. A worker that dies (or whose node dies) loses only its shard in flight: the shard goes
back to the front of the queue, a fresh worker replaces the dead one, and the next free worker
redoes it.
Workers need the input at the same path as the driver (a shared file system on a cluster); they
never write to OUTPUT_DIR.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NamedTuple

import ray
from ray.exceptions import RayError, RayTaskError

from pipeline.atomic import write_bytes_atomically
from pipeline.bench.markdown import plural
from pipeline.config import JobConfig, JobError, RayConfig, one_line
from pipeline.interrupt import JobInterrupted
from pipeline.job import RunShards
from pipeline.job_engine import build_engine, shard_context
from pipeline.shard import ShardContext, ShardHooks, run_shard
from pipeline.sources import InputPlan, Shard
from pipeline.stages.generate import EngineLike
from pipeline.stats import Counts
from runtime.config import EngineConfig

MAX_ATTEMPTS = 3  # a shard whose worker died this many times fails the job (it likely kills them)
_POLL_S = 1.0  # how often the driver asks the workers for progress
_CONNECT_S = 10.0


class Resources(NamedTuple):
    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: float


@contextmanager
def ray_runner(config: JobConfig, plan: InputPlan,
               engine_factory: Callable[[EngineConfig], EngineLike]) -> Iterator[RunShards]:
    """Connect to (or start) Ray, start the workers and wait for their engines; yield the function
    that runs shards on them. Workers are killed, and a Ray instance started here shut down, on
    exit. Raises JobError before anything is generated when Ray or an engine cannot start."""
    options = config.ray or RayConfig()
    with _connected(options, config.overwrite):
        resources = plan_resources(options, config.engine.device, ray.cluster_resources(),
                                   _largest_node_cpus())
        pool = _WorkerPool(config, plan.has_id_column, engine_factory, resources)
        try:
            pool.start()
            print(f"ray: {plural(resources.num_workers, 'worker')} ("
                  f"{_amount(resources.cpus_per_worker, 'CPU')}, "
                  f"{_amount(resources.gpus_per_worker, 'GPU')} each)", file=sys.stderr)
            yield pool.run_shards
        finally:
            pool.close()


def plan_resources(options: RayConfig, device: str, cluster: dict[str, float],
                   largest_node_cpus: float) -> Resources:
    """How many workers, and what each reserves. GPU workers (the default when the cluster has
    GPUs and --device is not cpu) take one CPU and --gpus-per-worker GPUs, one worker per GPU by
    default. CPU workers share the CPUs: one worker by default, and torch in each uses as many
    threads as CPUs it reserves (Ray sets OMP_NUM_THREADS to it)."""
    cpus, gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    per_gpu = options.gpus_per_worker
    if per_gpu is None:
        per_gpu = 1.0 if gpus >= 1 and device != "cpu" else 0.0
    if per_gpu > 0:
        workers = options.num_workers or max(1, int(gpus // per_gpu))
        per_cpu = 1.0
    else:
        workers = options.num_workers or 1
        per_cpu = float(max(1, min(int(cpus // workers), int(largest_node_cpus))))
    for name, need, have in (("CPU", per_cpu, cpus), ("GPU", per_gpu, gpus)):
        if need * workers > have:
            raise JobError(f"--num-workers {workers} with {_amount(need, name)} each needs "
                           f"{_amount(need * workers, name)}; the Ray cluster has {have:g}")
    return Resources(workers, per_cpu, per_gpu)


def _amount(count: float, unit: str) -> str:
    """'1 CPU', '0.5 GPUs', '2 CPUs'."""
    return f"{count:g} {unit}" + ("" if count == 1 else "s")


@contextmanager
def _connected(options: RayConfig, overwrite: bool = False) -> Iterator[None]:
    """Use the Ray this process is already connected to; else join options.address ("auto": the
    RAY_ADDRESS cluster or the one `ray start` runs here), or start a fresh local instance sized to
    this machine when there is none. Disconnect (and so stop a local instance) only if the
    connection was made here. ray.init puts in a SIGTERM handler of its own (sys.exit): the
    job's handlers are put back once it returns, and a SIGTERM it took is an interrupt."""
    if ray.is_initialized():
        yield
        return
    if options.address is not None:
        _check_reachable(options.address)
    ours = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if ours else {}
    try:
        if options.address is None:
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=options.address, logging_level=logging.WARNING)
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        ray.shutdown()
        raise JobInterrupted(signal.SIGTERM, overwrite) from None
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if options.address == "auto":  # Ray's message advises flags of its own CLI
            raise JobError("--ray-address auto: no Ray cluster found (none in RAY_ADDRESS, none "
                           "started by `ray start` on this machine); start one with `ray start "
                           "--head`, give its HOST:PORT, or leave --ray-address out to start a "
                           "local instance for this job") from None
        where = "a local instance" if options.address is None else repr(options.address)
        raise JobError(f"--ray-address: cannot connect to {where} "
                       f"({one_line(exc)})") from None
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    try:
        yield
    finally:
        ray.shutdown()


def _check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT where nothing listens (ray.init would retry for minutes), and
    on a form that is none of HOST:PORT, auto, local or ray://... (Ray logs a traceback first)."""
    if address in ("auto", "local") or "://" in address:
        return  # Ray's own forms: it judges them
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise JobError(f"--ray-address {address!r}: expected HOST:PORT, auto, or "
                       f"ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_S).close()
    except OSError as exc:
        raise JobError(f"--ray-address {address}: nothing answers there ({exc}); is the cluster "
                       f"up (ray start --head)?") from None


def _largest_node_cpus() -> float:
    return max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]), default=0.0)


class WorkerProgress(NamedTuple):
    shard_id: int | None  # the shard in flight (None before the first)
    rows: int  # input rows of it finished so far
    tokens: int  # tokens its engine steps reported so far
    prompt_tokens: int = 0  # of the rows finished so far (ShardHooks.rows_done)


class ShardResult(NamedTuple):
    part: bytes  # the part file, exactly as run_shard wrote it
    counts: Counts


class ShardWorker:
    """One engine, whole shards at a time (the body of a Ray actor; see the module docstring)."""

    def __init__(self, config: JobConfig, has_id_column: bool,
                 engine_factory: Callable[[EngineConfig], EngineLike]) -> None:
        self._lock = threading.Lock()
        self._progress = WorkerProgress(None, 0, 0)
        self._ctx: ShardContext | None = None
        self._error: str | None = None
        try:
            engine = build_engine(engine_factory, config.engine)
            self._ctx = shard_context(config, has_id_column, engine)
        except JobError as exc:  # returned by ready(), so the driver can raise it as it is
            self._error = str(exc)

    def ready(self) -> str | None:
        """None once the engine is loaded, else the JobError message that stopped it."""
        return self._error

    def run(self, shard: Shard) -> ShardResult:
        if self._ctx is None:
            raise JobError(self._error or "the worker has no engine")
        with self._lock:
            self._progress = WorkerProgress(shard.shard_id, 0, 0)
        hooks = ShardHooks(self._rows_done, self._tokens_generated, _never_stop)
        scratch = tempfile.mkdtemp(prefix="eaglebatch-shard-")  # left behind only if killed
        try:
            counts = run_shard(shard, self._ctx._replace(output_dir=scratch), hooks)
            with open(os.path.join(scratch, shard.part_name), "rb") as f:
                return ShardResult(f.read(), counts)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def progress(self) -> WorkerProgress:
        with self._lock:
            return self._progress

    def _rows_done(self, count: int, prompt_tokens: int) -> None:
        with self._lock:
            p = self._progress
            self._progress = p._replace(rows=p.rows + count,
                                        prompt_tokens=p.prompt_tokens + prompt_tokens)

    def _tokens_generated(self, count: int) -> None:
        with self._lock:
            p = self._progress
            self._progress = p._replace(tokens=p.tokens + count)


def _never_stop() -> None:
    """Workers are stopped by the driver killing them, never between stages."""


class _Task(NamedTuple):
    worker: Any  # the actor handle
    shard: Shard
    attempt: int


class _WorkerPool:
    """The driver's side: a queue of shards, one in flight per worker, dead workers replaced."""

    def __init__(self, config: JobConfig, has_id_column: bool,
                 engine_factory: Callable[[EngineConfig], EngineLike],
                 resources: Resources) -> None:
        self._config = config
        self._actor = ray.remote(ShardWorker).options(
            num_cpus=resources.cpus_per_worker, num_gpus=resources.gpus_per_worker,
            max_concurrency=2)  # progress() answers while run() generates
        self._args = (config, has_id_column, engine_factory)
        self._num_workers = resources.num_workers
        self._workers: list[Any] = []
        self._lost = 0

    def start(self) -> None:
        self._workers = [self._actor.remote(*self._args) for _ in range(self._num_workers)]
        for error in ray.get([w.ready.remote() for w in self._workers]):
            if error is not None:
                raise JobError(error)

    def close(self) -> None:
        for worker in self._workers:
            ray.kill(worker)
        if self._lost:
            print(f"ray: {plural(self._lost, 'worker')} lost and replaced; "
                  f"{'its shard was' if self._lost == 1 else 'their shards were'} redone",
                  file=sys.stderr)

    def run_shards(self, pending: list[Shard],
                   hooks: ShardHooks) -> Iterator[tuple[int, Counts]]:
        """Yield (shard id, counts) as shards finish (any order), each part file already renamed
        into OUTPUT_DIR: the caller commits it to the manifest before asking for the next."""
        queue = deque(_Task(None, _absolute(s), 1) for s in pending)
        idle = list(self._workers)
        busy: dict[Any, _Task] = {}  # ObjectRef of run() -> its task
        seen: dict[int, WorkerProgress] = {}  # shard id -> progress reported so far
        polled = time.monotonic()
        while queue or busy:
            while idle and queue:
                task = queue.popleft()._replace(worker=idle.pop())
                busy[task.worker.run.remote(task.shard)] = task
                seen[task.shard.shard_id] = WorkerProgress(task.shard.shard_id, 0, 0)
            done, _ = ray.wait(list(busy), num_returns=1, timeout=_POLL_S)
            if time.monotonic() - polled >= _POLL_S:
                self._report_progress(list(busy.values()), seen, hooks)
                polled = time.monotonic()
            hooks.check_stop()
            for ref in done:
                task = busy.pop(ref)
                so_far = seen.pop(task.shard.shard_id)
                result = self._result(ref, task)
                if result is None:  # the worker died: undo its progress, redo its shard
                    hooks.rows_done(-so_far.rows, -so_far.prompt_tokens)
                    queue.appendleft(task._replace(worker=None, attempt=task.attempt + 1))
                    idle.insert(0, self._replace(task.worker))  # idle.pop() prefers loaded ones
                    continue
                idle.append(task.worker)
                hooks.rows_done(task.shard.num_rows - so_far.rows,
                                result.counts.prompt_tokens - so_far.prompt_tokens)
                write_bytes_atomically(
                    os.path.join(self._config.output_dir, task.shard.part_name), result.part)
                yield task.shard.shard_id, result.counts
                # the tokens generated since the last poll (a shard shorter than the poll
                # interval had none on the bar, whose last line read 0.0 tok/s)
                if (rest := result.counts.completion_tokens - so_far.tokens) > 0:
                    hooks.on_step(rest)

    def _result(self, ref: Any, task: _Task) -> ShardResult | None:
        """The shard's result; None when its worker died (the shard is to be redone)."""
        try:
            result: ShardResult = ray.get(ref)
            return result
        except RayTaskError as exc:  # run_shard raised: the local runner would stop here too
            if isinstance(exc.cause, JobError):
                raise JobError(str(exc.cause)) from None
            raise
        except RayError as exc:  # the actor, its node or the result's object was lost
            if task.attempt >= MAX_ATTEMPTS:
                raise JobError(
                    f"shard {task.shard.shard_id} ({task.shard.file.path} rows "
                    f"{task.shard.start}-{task.shard.stop - 1}) lost its worker {task.attempt} "
                    f"times, last: {_first_line(exc)}; committed shards are kept, rerun to "
                    f"resume (with smaller --shard-rows or more memory)") from None
            print(f"ray: a worker died with shard {task.shard.shard_id} in flight "
                  f"({_first_line(exc)}); another worker redoes it", file=sys.stderr)
            return None

    def _replace(self, dead: Any) -> Any:
        self._lost += 1
        ray.kill(dead)
        fresh = self._actor.remote(*self._args)
        self._workers[self._workers.index(dead)] = fresh
        return fresh

    def _report_progress(self, tasks: list[_Task], seen: dict[int, WorkerProgress],
                         hooks: ShardHooks) -> None:
        """Forward rows and tokens the busy workers report to the progress bar (best effort: a
        worker too busy or dead to answer within the poll interval is asked again next time)."""
        refs = [t.worker.progress.remote() for t in tasks]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_POLL_S)
        for ref in ready:
            try:
                now: WorkerProgress = ray.get(ref)
            except RayError:
                continue
            before = None if now.shard_id is None else seen.get(now.shard_id)
            if before is None or now.shard_id is None:  # about a shard finished meanwhile
                continue
            seen[now.shard_id] = now
            if now.rows > before.rows:
                hooks.rows_done(now.rows - before.rows, now.prompt_tokens - before.prompt_tokens)
            if now.tokens > before.tokens:
                hooks.on_step(now.tokens - before.tokens)


def _absolute(shard: Shard) -> Shard:
    """Workers may run in another directory (or on another machine): give them absolute paths."""
    return replace(shard, file=replace(shard.file, path=os.path.abspath(shard.file.path)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

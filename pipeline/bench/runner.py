"""`eaglebatch bench`: every variant at every batch size, interleaved, then bench.parquet,
report.md and the plots.

For each batch size the variants (transformers, engine k=0, engine k=1, ...) are built once,
warmed up (transformers with one untimed static batch of that size), then run in rounds,
A B C A B C ..., so that drift of a shared machine (another job, clock changes) hits all of them
alike. At batch size 1 a round goes request by request (A B C on the first request, then on the
second, ...; each run's clock stops while the others run): every request runs alone either way,
and drift over the seconds of a whole run no longer lands on one variant. On a 2-core CPU whose
speed swings ~10% between runs, batch-1 ratios of one bench ranged 1.38x-1.75x round by round.
The engines of one batch size are freed before the next.
"""

from __future__ import annotations

import fcntl
import gc
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline.bench.bench_file import bench_metadata, write_bench_parquet
from pipeline.bench.config import (
    SCRATCH_PREFIX,
    BenchConfig,
    scratch_contents,
    scratch_leftovers,
)
from pipeline.bench.engine_run import EngineVariant, engine_config, measure_copy_bandwidth
from pipeline.bench.hf_baseline import TransformersBaseline
from pipeline.bench.metrics import (
    BENCH_FILE,
    CEILING,
    ENGINE,
    Agreement,
    RunRecord,
    bench_row,
    variant_label,
)
from pipeline.bench.models import BenchModels, resolve_models
from pipeline.bench.plots import report_dir
from pipeline.bench.report import REPORT_FILE, remove_report, write_bench_report
from pipeline.bench.workload import Workload, build_workload, read_prompts
from pipeline.config import JobError
from pipeline.manifest import MANIFEST_FILE
from pipeline.stats import STATS_FILE
from runtime.config import EngineConfig, PlacementError
from runtime.cpu_gemm import q4_weight_count
from runtime.engine import Engine
from runtime.host_memory import return_freed_memory
from runtime.loader import eos_token_ids, load_model_config, load_tokenizer
from runtime.rope import context_length
from runtime.setup import place


def run_bench(config: BenchConfig) -> Path:
    """Run the benchmark of `config`; returns the path of report.md. A bench that fails leaves
    no --out directory behind where there was none."""
    out = Path(config.out)
    job_files = [name for name in (MANIFEST_FILE, STATS_FILE) if (out / name).exists()]
    if job_files:
        raise JobError(f"--out {out} holds a job's {job_files[0]}: a bench report there would "
                       "replace the job's report; pick another directory")
    earlier = [name for name in (BENCH_FILE, REPORT_FILE) if (out / name).exists()]
    if earlier and not config.overwrite:
        what = (f"an earlier bench's {BENCH_FILE}" if earlier[0] == BENCH_FILE
                else f"a {REPORT_FILE}")
        theirs = " and its report" if earlier[0] == BENCH_FILE else ""
        raise JobError(f"--out {out} holds {what}: pass --overwrite to replace it{theirs}, or "
                       "pick another directory")
    created = not out.exists()
    report_dir(out)
    try:
        with _locked(out):
            return _run_bench(config, out)
    except OSError as exc:  # a read-only or full --out; another file's error is not ours
        if exc.filename is None or not Path(os.path.abspath(exc.filename)).is_relative_to(
                os.path.abspath(out)):  # (a sibling 'out2' is not under 'out')
            raise
        raise JobError(f"--out {out}: cannot write {exc.filename} ({exc.strerror})") from None
    finally:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One bench per --out at a time: a second one would remove the first one's scratch models
    as a killed bench's, and write over its bench.parquet."""
    lock_path = out / _LOCK_FILE
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(f"--out {out}: another bench is writing there") from None
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)


_LOCK_FILE = ".eaglebatch-bench.lock"


def _ignore_interrupts() -> None:
    """After the interrupt that stops a bench: its rounds are being saved, and a second Ctrl-C
    must not cut that short (the command exits right after)."""
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to do
        pass


def _run_bench(config: BenchConfig, out: Path) -> Path:
    base = EngineConfig(dtype=config.dtype, device=config.device,
                        kv_cache_memory=config.kv_cache_memory,
                        max_num_batched_tokens=config.max_num_batched_tokens,
                        draft_confidence=config.draft_confidence,
                        draft_int8=config.draft_int8, q4_panels=config.q4_panels,
                        draft_max_batch=config.draft_max_batch,
                        draft_ngram=config.draft_ngram,
                        draft_ngram_tokens=config.draft_ngram_tokens,
                        attention_backend=config.attention_backend,
                        cuda_graphs=config.cuda_graphs,
                        enable_prefix_caching=config.prefix_caching)
    try:
        p = place(base)
    except PlacementError as exc:
        raise JobError(str(exc)) from None
    if config.threads is not None:
        torch.set_num_threads(config.threads)  # for the rest of this process
    # read before any model is built or loaded (a random 8B checkpoint takes minutes)
    prompts = read_prompts(config.prompts, config.prompt_column, config.num_prompts,
                           config.messages_column)
    _remove_stale_scratch(out)
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=out) as scratch:
        models = resolve_models(config, Path(scratch), p.dtype, p.device)
        if models.random_drafter:  # random drafts are all unlikely: gating would cut them all
            base = replace(base, draft_confidence=0.0)
            config = replace(config, draft_confidence=0.0)
        tokenizer = load_tokenizer(models.model_dir)
        max_model_len = context_length(load_model_config(models.model_dir))
        workload = build_workload(prompts, config.prompt_column, config.messages_column,
                                  tokenizer, max_model_len, config.max_tokens,
                                  config.chat_template, config.ignore_eos or models.random)
        bandwidth = measure_copy_bandwidth(p.device) if p.device.type == "cuda" else None
        meta = bench_metadata(config, models, workload, p, bandwidth, max_model_len)
        meta["prompt_format"] = _prompt_format(config, tokenizer)
        _log(f"bench: {meta['model']} ({meta['dtype']}, {meta['device']}, "
             f"{meta['threads']} threads), {len(workload.prompts)} prompts, "
             f"max {config.max_tokens} tokens, batch sizes {list(config.batch_sizes)}, "
             f"k {list(config.ks)}, {config.repeats} repeats")
        baseline = None
        if config.baseline == "transformers":
            baseline = TransformersBaseline(models.model_dir, p.device, p.dtype,
                                            eos_token_ids(models.model_dir, tokenizer),
                                            tokenizer.pad_token_id)
        rows: list[dict[str, Any]] = []  # of the batch sizes done
        reference: dict[str, tuple[int, ...]] | None = None

        def save(records: list[tuple[int, RunRecord]]) -> list[dict[str, Any]]:
            """bench.parquet with the rounds done so far (after every round: a bench killed
            with SIGKILL keeps them); returns its rows."""
            nonlocal reference
            if not rows:  # an earlier bench's report is not this one's
                remove_report(out)
            if reference is None:
                reference = next(r.outputs for _, r in records if r.variant == ENGINE)
            now = rows + [bench_row(record, len(rows) + i, repeat,
                                    Agreement(reference, record.outputs))
                          for i, (repeat, record) in enumerate(records)]
            write_bench_parquet(out / BENCH_FILE, now, meta)
            return now

        for batch_size in config.batch_sizes:
            records: list[tuple[int, RunRecord]] = []  # filled round by round
            try:
                _bench_batch_size(config, models, workload, base, batch_size, baseline,
                                  bandwidth, meta, records, save)
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as the command turns it
                _ignore_interrupts()
                meta["interrupted"] = batch_size
            _free_engines()
            if records:
                rows = save(records)
            if "interrupted" in meta:
                break
    if "interrupted" in meta:
        raise BenchInterrupted(write_bench_report(str(out)) if rows else None)
    return write_bench_report(str(out))


class BenchInterrupted(Exception):  # noqa: N818  (an interrupt, not an error)
    """Ctrl-C or SIGTERM stopped the bench: `report` is the report of the rounds that finished
    before it, or None where none had (an earlier bench's files in --out are left as they were)."""

    def __init__(self, report: Path | None) -> None:
        super().__init__("bench interrupted")
        self.report = report


def _free_engines() -> None:
    """Frees the engines of the batch size that just ran (their frame is gone; the cycles
    among their objects wait for the collector) and hands what glibc kept of them back to the
    system, so that the next batch size's peak RSS is its own, not theirs as well."""
    gc.collect()
    return_freed_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _bench_batch_size(config: BenchConfig, models: BenchModels, workload: Workload,
                      base: EngineConfig, batch_size: int,
                      baseline: TransformersBaseline | None,
                      bandwidth: float | None, meta: dict[str, Any],
                      records: list[tuple[int, RunRecord]],
                      on_round: Callable[[list[tuple[int, RunRecord]]], object]) -> None:
    """Appends (repeat, record) of every timed run to `records`, in the order they ran, round by
    round (an interrupt leaves the rounds that finished), calling on_round(records) after each;
    notes in `meta` how many of the model's weight matrices got 4-bit panels (with
    --q4-panels, on the CPU)."""
    # --ceiling: always k drafts (no confidence cut, at any batch), replaced by the k = 0 run's
    # tokens; they run after k = 0 in every round, so its first run's outputs are there in time
    wanted = [(ENGINE, k, base) for k in config.ks] + [
        (CEILING, k, replace(base, draft_confidence=0.0, draft_max_batch=None))
        for k in (config.speculative_ks if config.ceiling else ())]
    # One copy of the target's weights for all variants: the largest k is built first (its
    # rotary tables cover the most positions) and the others run on its model.
    built: dict[int, EngineVariant] = {}
    first: Engine | None = None
    for i in sorted(range(len(wanted)), key=lambda i: -wanted[i][1]):
        name, k, engine_base = wanted[i]
        built[i] = EngineVariant(engine_config(models.model_dir, models.drafter, k, batch_size,
                                               workload, engine_base), k, bandwidth, name, first)
        first = first or built[i].engine
    variants = [built[i] for i in range(len(wanted))]
    del built
    if config.q4_panels and first is not None and first.placement.device.type == "cpu":
        # the decoder's products (the head never reads 4-bit panels)
        meta["q4_weights"] = list(q4_weight_count(first.model.model))
    for variant in variants:
        variant.warm_up(workload)
    engines = [v for v in variants if v.variant == ENGINE]
    ceilings = [v for v in variants if v.variant == CEILING]
    if baseline is not None:
        baseline.warm_up(workload, batch_size)
    runs_per_round = len(variants) + (baseline is not None)
    # on a terminal only: in a log (a file or pipe) its carriage-return redraws made one long
    # line, and the line _timed writes after each run says the progress there
    bar = tqdm(total=config.repeats * runs_per_round * len(workload.prompts), unit="request",
               desc=f"batch {batch_size}", file=sys.stderr, dynamic_ncols=True, leave=False,
               disable=not sys.stderr.isatty())
    try:
        for repeat in range(config.repeats):
            runs: list[RunRecord | None] = [None] * (len(engines) + len(ceilings) + 1)
            for part in turns(workload, batch_size):
                if baseline is not None:
                    runs[-1] = baseline.run(part, batch_size, runs[-1])
                for i, variant in enumerate(engines):
                    first_part = runs[i] is None
                    runs[i] = record = variant.run(part, runs[i])
                    if variant.k == 0 and repeat == 0 and first_part:
                        # the ceilings draft these outputs (the later parts add theirs in place)
                        for ceiling in ceilings:
                            ceiling.engine.draft_from_reference(record.outputs)
                for i, variant in enumerate(ceilings, start=len(engines)):
                    runs[i] = variant.run(part, runs[i])
                bar.update(runs_per_round * len(part.prompts))
            in_order = runs[-1:] + runs[:-1]  # the baseline first, as the rounds ran
            plain = next((v for v in engines if v.k == 0), None)  # (--k 2,0 lists it second)
            if repeat == 0 and plain is not None:  # what the prefix cache served in its run
                meta.setdefault("prefix_cache_hits", {})[str(batch_size)] = list(
                    plain.prefix_hits)
            records += [(repeat, _timed(record)) for record in in_order if record is not None]
            on_round(records)
    finally:
        bar.close()


def turns(workload: Workload, batch_size: int) -> list[Workload]:
    """The parts of the workload that the variants run in turn within a round: one request at a
    time at batch size 1 (where requests run alone anyway), else the whole workload."""
    if batch_size != 1:
        return [workload]
    return [workload.part(i, i + 1) for i in range(len(workload.prompts))]


def _timed(record: RunRecord) -> RunRecord:
    tokens = sum(len(t) for t in record.outputs.values())
    seconds = record.end - record.t0
    _log(f"  B={record.batch_size:<3} {variant_label(record.variant, record.k):<18} "
         f"{tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s")
    return record


def _prompt_format(config: BenchConfig, tokenizer: Any) -> str:
    """How prompts became tokens, for the report's header (report_header._PROMPT_FORMATS)."""
    if config.messages_column is not None:
        return "messages"
    if not config.chat_template:
        return "raw"
    return "chat" if getattr(tokenizer, "chat_template", None) else "raw: no template"


def _remove_stale_scratch(out: Path) -> None:
    """A bench killed outright cannot remove its scratch directory; the next bench into the
    same --out removes it."""
    for stale, size in scratch_leftovers(out):
        shutil.rmtree(stale, ignore_errors=True)
        _log(f"bench: removed {stale.name} ({scratch_contents(size)}), left in --out "
             f"by a bench that was killed")


def _log(line: str) -> None:
    tqdm.write(line, file=sys.stderr)  # above a progress bar, if one is drawn

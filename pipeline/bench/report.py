"""REPORT_DIR/report.md and its PNG plots, from REPORT_DIR/bench.parquet alone (so a report can
be redrawn later with `eaglebatch report REPORT_DIR`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pipeline.atomic import write_bytes_atomically
from pipeline.bench import markdown as md
from pipeline.bench.aggregate import (
    Key,
    Summary,
    acceptance_by_k,
    batch_sizes,
    best_k,
    ceiling_ks,
    engine_ks,
    ratio,
    round_ratios,
    speedup_vs_k0,
    summarize,
)
from pipeline.bench.bench_file import read_bench_parquet
from pipeline.bench.metrics import BENCH_FILE, CEILING, ENGINE, TRANSFORMERS, variant_label
from pipeline.bench.plots import (
    drop_undrawn,
    plot_acceptance,
    plot_speedup,
    plot_throughput,
    report_dir,
)
from pipeline.bench.report_header import acceptance_meaningless, header, on_cuda

REPORT_FILE = "report.md"
PLOTS = {"throughput": "tokens_per_s_by_batch.png", "speedup": "speedup_by_k.png",
         "acceptance": "acceptance_by_position.png"}


def write_bench_report(bench_dir: str, out_dir: str | None = None) -> Path:
    """Reads bench_dir/bench.parquet; writes report.md and the PNGs to out_dir (or bench_dir)."""
    rows, meta = read_bench_parquet(Path(bench_dir) / BENCH_FILE)
    out = report_dir(Path(out_dir or bench_dir))
    summaries = summarize(rows)
    meaningless = acceptance_meaningless(meta)
    drawn = {
        "throughput": plot_throughput(summaries, out / PLOTS["throughput"]),
        "speedup": plot_speedup(summaries, out / PLOTS["speedup"]),
        "acceptance": plot_acceptance(
            {f"k={k}": c for k, c in acceptance_by_k(rows).items()}, out / PLOTS["acceptance"],
            "Acceptance by draft position" + (f" ({meaningless})" if meaningless else "")),
    }
    drop_undrawn(out, PLOTS, drawn)
    rounds = {b: len({r["repeat"] for r in rows if r["batch_size"] == b})
              for b in batch_sizes(summaries)}
    sections = [header(meta, batch_sizes(summaries), rounds), equality_section(rows, meta),
                _throughput(summaries),
                _ratios(summaries), _acceptance(rows, meta), _bandwidth(summaries, meta),
                _plots(drawn), _DEFINITIONS]
    path = out / REPORT_FILE
    write_bytes_atomically(str(path), ("\n\n".join(s for s in sections if s) + "\n").encode())
    return path


def remove_report(out: Path) -> None:
    """Removes report.md and the plots: they describe an earlier bench.parquet."""
    for name in (REPORT_FILE, *PLOTS.values()):
        (out / name).unlink(missing_ok=True)


def equality_section(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    engine_rows = [r for r in rows if r["variant"] != TRANSFORMERS]
    if not engine_rows:
        return ""
    bad = [r for r in engine_rows if r["outputs_equal"] != r["outputs_compared"]]
    first = engine_rows[0]
    reference = f"engine k={first['k']} at batch {first['batch_size']} (first run)"
    if len(engine_rows) == 1:
        verdict = ("**Not checked**: there was one engine run, with nothing to compare it to "
                   "(more k values, batch sizes or repeats give the check its runs).")
    elif not bad:
        verdict = (f"**PASS**: all {len(engine_rows)} engine runs produced exactly the same "
                   f"tokens as {reference} for "
                   + ("its one request." if first["outputs_compared"] == 1 else
                      f"all {first['outputs_compared']} requests."))
    else:
        verdict = (f"**FAIL**: {len(bad)} of {len(engine_rows)} engine runs differ from "
                   f"{reference}:\n\n" + md.table(
                       ["batch", "variant", "repeat", "equal requests", "first divergence"],
                       [[str(r["batch_size"]), variant_label(r["variant"], r["k"]),
                         str(r["repeat"]), f"{r['outputs_equal']}/{r['outputs_compared']}",
                         f"token {r['first_divergence']}"] for r in bad]))
        verdict += "\n\n" + _why_unequal(meta)
    lines = ["## Output equality (greedy: every engine variant must give the same tokens)", "",
             verdict]
    hf = [r for r in rows if r["variant"] == TRANSFORMERS]
    if hf:
        equal = min(r["outputs_equal"] for r in hf)
        lines += ["", f"transformers (not part of the check; padded batches change its "
                  f"arithmetic): {equal}/{hf[0]['outputs_compared']} requests identical in "
                  "its worst run."]
    return "\n".join(lines)


def exact_arithmetic(meta: dict[str, Any]) -> bool:
    """Whether the engine promises bit-equal tokens across batch sizes and k in this run: float32
    on the CPU kernels (each row's arithmetic does not depend on the rest of the batch; the cpu
    backend runs on the CPU only)."""
    return meta.get("dtype") == "float32" and meta.get("attention_backend") == "cpu"


def _why_unequal(meta: dict[str, Any]) -> str:
    if exact_arithmetic(meta):
        return ("This is a bug: in float32 on the CPU kernels every row is computed the same "
                "way whatever else is in the batch, so the variants must agree. Please report "
                "it with this bench.parquet.")
    where = "on CUDA" if on_cuda(meta) else "here"
    return (f"Expected with {meta.get('dtype')} and the {meta.get('attention_backend')} "
            f"attention backend {where}: the products' and attention's rounding depends on how "
            "many rows a step has (the libraries pick kernels by shape), so a verified row is "
            "rounded differently from a decoded one and greedy tokens part where two candidates "
            "nearly tie. Bit-equal outputs are guaranteed in float32 on the CPU kernels "
            "(`--dtype float32 --attention-backend cpu`, the CPU defaults).")


_TIMES = ("latency_mean_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s")


def _throughput(summaries: dict[Key, Summary]) -> str:
    longest = max((v for s in summaries.values() for f in _TIMES
                   if (v := s.median(f)) is not None), default=0.0)
    unit, scale, digits = ("ms", 1000.0, 1) if longest < 1.0 else ("s", 1.0, 2)

    def when(s: Summary, field: str) -> str:
        value = s.median(field)
        if value is not None and 0 < value * scale < 0.5 * 10 ** -digits:  # not '0.00'
            return f"{value * scale:.2g}"
        return md.num(None if value is None else value * scale, digits)

    headers = ["batch", "variant", "tokens/s", "spread", "requests/s", f"latency mean {unit}",
               f"p50 {unit}", f"p99 {unit}", f"TTFT p50 {unit}", f"TTFT p99 {unit}",
               "acceptance", "accept len", "peak RSS MiB"]
    rows = [[str(s.batch_size), variant_label(s.variant, s.k), md.num(s.tokens_per_s),
             "–" if s.spread is None else f"±{50 * s.spread:.1f}%",
             md.num(s.median("requests_per_s"), 2), *[when(s, f) for f in _TIMES],
             md.pct(s.acceptance.derived()["acceptance_rate"]),
             md.num(s.acceptance.derived()["mean_acceptance_length"], 2),
             md.mib(s.median("peak_rss_bytes"))] for s in summaries.values()]
    if any(s.median("peak_gpu_bytes") for s in summaries.values()):
        headers.append("peak GPU MiB")
        for row, s in zip(rows, summaries.values(), strict=True):
            row.append(md.mib(s.median("peak_gpu_bytes")))
    return ("## Throughput and latency (medians of the repeats)\n\n" + md.table(headers, rows)
            + "\n\nLatency and TTFT count from the run's start, where every request is "
            "submitted (an offline batch): they include the time a request waited for a place "
            "in the batch, which at batch size 1 is every earlier request's.")


def _ratios(summaries: dict[Key, Summary]) -> str:
    sizes = batch_sizes(summaries)
    ks = [k for k in engine_ks(summaries) if k > 0]
    parts = ["## Ratios (output tokens/s, medians)"]
    if any((b, TRANSFORMERS, 0) in summaries for b in sizes) and 0 in engine_ks(summaries):
        parts.append("Engine without drafter over transformers `generate` (static batches):\n\n"
                     + md.table(["batch", "engine k=0", "transformers", "ratio"], [
                         [str(b), md.num(_tps(summaries, (b, ENGINE, 0))),
                          md.num(_tps(summaries, (b, TRANSFORMERS, 0))),
                          ratio_cell(summaries, (b, ENGINE, 0), (b, TRANSFORMERS, 0))]
                         for b in sizes]))
    if ks and 0 in engine_ks(summaries):
        parts.append("With the drafter over without it (same batch size):\n\n" + md.table(
            ["batch", *[f"k={k}" for k in ks]],
            [[str(b), *[ratio_cell(summaries, (b, ENGINE, k), (b, ENGINE, 0)) for k in ks]]
             for b in sizes]) + _undrafted(summaries, sizes, ks))
    ceilings = ceiling_ks(summaries)
    if ceilings and 0 in engine_ks(summaries):
        parts.append("Ceiling: perfect drafts over k=0 (every draft accepted, drafting cost "
                     "kept): the most any drafter as costly as this one could gain. Where it "
                     "is near 1.0x, verification costs as much as decoding at that batch size "
                     "and no drafter can help:\n\n" + md.table(
                         ["batch", *[f"k={k}" for k in ceilings]],
                         [[str(b), *[ratio_cell(summaries, (b, CEILING, k), (b, ENGINE, 0))
                                     for k in ceilings]] for b in sizes]))
    best = [(b, s) for b in sizes if (s := best_k(summaries, b)) is not None]
    with_hf = any((b, TRANSFORMERS, 0) in summaries for b in sizes)
    if best and ks:
        parts.append("Best k per batch size:\n\n" + md.table(
            ["batch", "best k", "tokens/s", "vs k=0", *(["vs transformers"] if with_hf else [])],
            [[str(b), str(s.k), md.num(s.tokens_per_s), _best_vs_k0(summaries, b, s.k),
              *([md.ratio(ratio(summaries, (b, ENGINE, s.k), (b, TRANSFORMERS, 0)))]
                if with_hf else [])]
             for b, s in best]))
    return "\n\n".join(parts) if len(parts) > 1 else ""


def _undrafted(summaries: dict[Key, Summary], sizes: list[int], ks: list[int]) -> str:
    """A note naming the k > 0 variants none of whose runs drafted a token (every draft cut
    below the confidence, steps larger than --draft-max-batch, no token left to draft): their
    ratios measure keeping the drafter, not drafting."""
    idle = [f"batch {b} k={k}" for b in sizes for k in ks
            if (s := summaries.get((b, ENGINE, k))) is not None
            and not any(r.get("drafted") for r in s.runs)]
    if not idle:
        return ""
    return (f"\n\nNothing was drafted at {', '.join(idle)} (drafts cut below the confidence, "
            "steps larger than `--draft-max-batch`, or no token left to draft): "
            + ("that ratio measures" if len(idle) == 1 else "those ratios measure")
            + " keeping the drafter, not drafting.")


def _best_vs_k0(summaries: dict[Key, Summary], batch_size: int, k: int) -> str:
    """The best k's ratio over k = 0, marked where its rounds fall on both sides of 1.0x: which
    k (or none) is best is then not known from this bench: '1.04x (not above the noise: rounds
    0.93-1.12)'."""
    cell = md.ratio(speedup_vs_k0(summaries, batch_size, k))
    rounds = round_ratios(summaries, (batch_size, ENGINE, k), (batch_size, ENGINE, 0))
    if k and len(rounds) > 1 and rounds[0] <= 1.0 <= rounds[-1]:
        cell += f" (not above the noise: rounds {rounds[0]:.2f}-{rounds[-1]:.2f})"
    return cell


def ratio_cell(summaries: dict[Key, Summary], top: Key, bottom: Key) -> str:
    """'1.46x (1.31-1.52)': the ratio of the medians, then the lowest and highest ratio within
    one round when there were several rounds, and from three rounds on the median of the rounds'
    own ratios: '1.46x (1.31-1.52, rounds' median 1.49x)'."""
    rounds = round_ratios(summaries, top, bottom)
    cell = md.ratio(ratio(summaries, top, bottom))
    if len(rounds) < 2:
        return cell
    paired = f", rounds' median {md.ratio(statistics.median(rounds))}" if len(rounds) > 2 else ""
    return f"{cell} ({rounds[0]:.2f}-{rounds[-1]:.2f}{paired})"


def _tps(summaries: dict[Key, Summary], key: Key) -> float | None:
    s = summaries.get(key)
    return s.tokens_per_s if s else None


def _acceptance(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    by_k = acceptance_by_k(rows)
    if not by_k:
        return ""
    longest = max(len(c.accepted_per_position) for c in by_k.values())
    table = md.table(
        ["k", "drafted", "acceptance rate", "mean acceptance length",
         *[f"pos {j + 1}" for j in range(longest)]],
        [[str(k), f"{c.drafted:,}", md.pct(d["acceptance_rate"]),
          md.num(d["mean_acceptance_length"], 2),
          *[md.pct(v) for v in d["per_position_acceptance"]],
          *["" for _ in range(longest - len(d["per_position_acceptance"]))]]
         for k, c in by_k.items() for d in [c.derived()]])
    meaningless = acceptance_meaningless(meta)
    note = f" ({meaningless})" if meaningless else ""
    beyond = [k for k, c in by_k.items() if len(c.accepted_per_position) > k]
    lookups = (f"\n\nPositions past k (k = {', '.join(map(str, beyond))}): n-gram lookup drafts, "
               "of which a greedy request alone in its step may take more than k "
               "(`--draft-ngram-tokens`)." if beyond else "")
    return f"## Acceptance (all batch sizes and repeats){note}\n\n{table}{lookups}"


def _bandwidth(summaries: dict[Key, Summary], meta: dict[str, Any]) -> str:
    bandwidth = meta.get("copy_bandwidth_bytes_per_s")
    rows = [s for s in summaries.values() if s.median("bandwidth_floor_s")]
    if not bandwidth or not rows:
        return ""
    return (f"## Decode step against the memory-bandwidth floor\n\nFloor = (target weight bytes "
            f"+ KV bytes of the running context) / measured device copy bandwidth "
            f"({bandwidth / 1e9:,.0f} GB/s); the drafter's reads are not in the floor.\n\n"
            + md.table(["batch", "variant", "decode step ms", "floor ms", "step / floor"], [
                [str(s.batch_size), variant_label(s.variant, s.k),
                 md.num(1000 * (s.median("decode_step_s") or 0), 2),
                 md.num(1000 * (s.median("bandwidth_floor_s") or 0), 2),
                 md.ratio((s.median("decode_step_s") or 0) / (s.median("bandwidth_floor_s") or 1))]
                for s in rows]))


_NOT_DRAWN = {"throughput": "no runs", "speedup": "it needs runs at k = 0 and at some k > 0",
              "acceptance": "no run drafted a token"}


def _plots(drawn: dict[str, Any]) -> str:
    lines = ["## Plots", ""]
    for name, series in drawn.items():
        if series is None:
            lines.append(f"- {name}: not drawn ({_NOT_DRAWN[name]})")
        else:
            lines.append(f"![{name}]({PLOTS[name]})")
    return "\n".join(lines)


_DEFINITIONS = """## Definitions

- tokens/s: generated tokens of all requests / wall time of the run (model loading and warm-up
  excluded: transformers first runs one untimed static batch at each batch size, the engines one
  request); spread: ±half of (max - min) / median over the repeats.
- ratios: of the medians; in brackets, the lowest and highest ratio of two runs in the same
  round (a round runs every variant of a batch size once, back to back, so a drift of the
  machine's speed cancels within it but not between the medians) and, from three rounds on,
  the median of the rounds' ratios (the figure least moved by such drift). Where the header
  says so, a round at batch size 1 takes the requests one at a time, each through every variant
  in turn, and a run's clock stops while the others have their turn: drift cancels over
  seconds, not only over whole runs.
- latency: a request's finish time - the run's start (all requests are submitted at the start;
  with turns at batch size 1, on the run's own clock); TTFT: its first generated token's time -
  the run's start. transformers' requests finish with their static batch.
- perfect drafts k=K (`--ceiling`): the engine with the drafter at k = K, whose drafts are
  replaced by the k = 0 run's next tokens (all accepted); not in the acceptance table.
- acceptance: accepted / drafted; accept len: 1 + accepted / draft steps (tokens per
  verification step); pos j: draft steps whose j-th draft token was accepted / draft steps.
- peak RSS / GPU: the process's resident (GPU) memory at its highest during the run, sampled
  every step; it holds every variant of the batch size (and the transformers model) at once, so
  it is an upper bound for one variant. The engines of earlier batch sizes are freed before."""

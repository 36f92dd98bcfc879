"""`eaglebatch bench` and `eaglebatch report`. Options map 1:1 onto BenchConfig / ReportConfig."""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from jobs.options import finite, memory_size, not_blank
from pipeline.bench.config import BASELINES, BenchConfig, ReportConfig, parse_int_list
from pipeline.bench.presets import preset_names
from pipeline.config import JobError
from runtime.config import CLI_DRAFT_CONFIDENCE, CLI_DRAFT_NGRAM_TOKENS, DEFAULT_MODEL

_EXIT_USER_ERROR = 2


def _ints(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """--batch-sizes (integers >= 1) and --k (>= 0)."""
    try:
        return parse_int_list(value, minimum=0 if param.name == "ks" else 1)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None




@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True, callback=not_blank,
              help="Built-in model name, checkpoint directory, .gguf file, or random:<preset> "
                   "(random weights in a real architecture's shape: "
                   f"{', '.join(preset_names())}) or random:<config.json or directory "
                   "holding one> (any model's shape, from its config alone) for pure "
                   "throughput measurements, with a byte-level tokenizer (one token per UTF-8 "
                   "byte, so prompts run longer); acceptance figures mean nothing for them.")
@click.option("--drafter", default="auto", show_default=True, callback=not_blank,
              help="EAGLE drafter checkpoint directory for the k > 0 variants; 'auto': the one "
                   "shipped for the model (random weights for random:<preset>); 'random': a "
                   "random one-layer drafter (measures drafting cost only); 'none'.")
@click.option("--prompts", required=True,
              help="Parquet file of prompts (read before any model is loaded); other columns "
                   "are ignored, and null, empty or too-long prompts and malformed messages "
                   "are left out (the report counts them).")
@click.option("--prompt-column", default="prompt", show_default=True,
              help="Column of --prompts holding the prompt text.")
@click.option("--messages-column", default=None,
              help="Column of --prompts holding chat messages (list<struct<role, content>>), "
                   "rendered with the model's chat template as `generate --messages-column` "
                   "does; replaces --prompt-column.")
@click.option("--num-prompts", default=None, type=click.IntRange(1),
              help="Use the first N prompts (default: all).")
@click.option("--no-chat-template", "no_chat_template", is_flag=True,
              help="Tokenize prompts as raw text, not as a chat user message.")
@click.option("--out", required=True, callback=not_blank,
              help="REPORT_DIR: bench.parquet, report.md and PNG plots.")
@click.option("--overwrite", is_flag=True,
              help="Replace an earlier bench's bench.parquet, report.md and plots in --out, "
                   "or any report.md there (without it such an --out is refused); they go "
                   "once the first round of this bench is written.")
@click.option("--batch-sizes", default="1,4,16,64", show_default=True, callback=_ints,
              help="Comma-separated batch sizes: the engine's --max-num-seqs and the static "
                   "batch size of the transformers baseline.")
@click.option("--k", "ks", default="0,1,2,3,5", show_default=True, callback=_ints,
              help="Comma-separated draft tokens per step; 0 is the engine without drafter, "
                   "which always runs (every ratio is taken against it): --k 2,3 runs 0,2,3.")
@click.option("--draft-confidence", default=CLI_DRAFT_CONFIDENCE, show_default=True,
              type=click.FloatRange(0, 1, max_open=True), callback=finite,
              help="As in `generate`: drafts are cut, and drafting stops, where the drafter's "
                   "probability of the drafts so far falls below this (a greedy request alone "
                   "still verifies the draft that fell below); 0 always drafts k. Not applied "
                   "with random weights or `--drafter random` (their confidence means nothing): "
                   "k drafts every step.")
@click.option("--draft-max-batch", default=0, show_default=True, type=click.IntRange(0),
              help="As in `generate`: greedy requests get no drafts in steps with more than "
                   "this many requests. 0 (here the default): the k > 0 variants draft at every "
                   "batch size, so the report shows what drafting itself gains or loses there; "
                   "pass `generate`'s default (4) to measure its policy of drafting only as "
                   "a batch drains.")
@click.option("--draft-ngram/--no-draft-ngram", default=None,
              help="As in `generate`: n-gram lookup drafts where the text repeats [default: on; "
                   "off with random weights or `--drafter random`, whose runs measure what "
                   "drafting costs: random text repeats, and accepted lookups would hide it].")
@click.option("--draft-ngram-tokens", default=CLI_DRAFT_NGRAM_TOKENS, show_default=True,
              type=click.IntRange(0),
              help="As in `generate`: a greedy request alone in its step (batch 1) may take up "
                   "to this many lookup drafts, more than k; 0: k.")
@click.option("--draft-int8/--no-draft-int8", default=True, show_default=True,
              help="As in `generate`: on the CPU, run the drafter on int8 copies of its "
                   "weights (one scale per output); outputs are the same either way.")
@click.option("--q4-panels/--no-q4-panels", default=False, show_default=True,
              help="As in `generate`: on the CPU, small products of every engine variant read "
                   "4-bit copies of weights that are exactly GGUF Q4_1 values; outputs are the "
                   "same either way.")
@click.option("--attention-backend", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "cpu", "flash"]),
              help="Attention backend of the engine variants (as in `generate`).")
@click.option("--cuda-graphs/--no-cuda-graphs", default=False, show_default=True,
              help="As in `generate`: the engine variants replay decode steps from CUDA graphs "
                   "(CUDA, torch attention backend).")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="As `generate` always does: requests reuse the KV of the prompt blocks they "
                   "share (a chat template's system prompt). Each engine's cache is emptied "
                   "before each run, so no run reuses an earlier run's prompts; the report says "
                   "how many prompt tokens the cache served.")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1),
              help="New tokens per request at most (exactly, for random models: EOS ignored).")
@click.option("--baseline", default="transformers", show_default=True,
              type=click.Choice(BASELINES),
              help="transformers: also run transformers `generate` on static batches of each "
                   "batch size (the report's engine/transformers ratios); none: engines only.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1),
              help="Timed runs of every variant, in rounds (A B C, A B C, ...; at batch size 1 "
                   "request by request); the report shows medians and the spread.")
@click.option("--ignore-eos", is_flag=True,
              help="Generate exactly --max-tokens per request (equal work for every variant).")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Weights and activations of every variant; auto: float32 on CPU, bfloat16 "
                   "on CUDA.")
@click.option("--device", default="auto", show_default=True,
              type=click.Choice(["auto", "cpu", "cuda"]),
              help="auto: CUDA when available, else CPU.")
@click.option("--kv-cache-memory", default=None, callback=memory_size,
              help="KV cache per engine, e.g. 2GiB (default: enough for the whole batch).")
@click.option("--max-num-batched-tokens", default=2048, show_default=True,
              type=click.IntRange(1), help="Token budget of one engine step.")
@click.option("--threads", default=None, type=click.IntRange(1),
              help="torch CPU threads (default: torch's choice, one per core).")
@click.option("--ceiling", is_flag=True,
              help="Also run every k > 0 with perfect drafts: the drafter runs as usual (its "
                   "cost stays in every step), but its drafts are replaced by the k = 0 run's "
                   "own next tokens, so all are accepted. Shows the most any drafter of this "
                   "cost could gain at each batch size. Needs a k > 0 in --k.")
def bench(**options: Any) -> None:
    """Measure the engine with and without speculative decoding against transformers `generate`,
    side by side and interleaved, and write bench.parquet, report.md and PNG plots to --out."""
    from pipeline.bench.commands import bench as run  # imported here: `--help` needs no torch
    from pipeline.bench.runner import BenchInterrupted  # noqa: PLC0415

    o = options
    if 0 not in o["ks"]:
        click.echo(f"--k {','.join(map(str, o['ks']))}: adding k = 0 (the engine without "
                   "drafter), which every ratio is taken against", err=True)
        o["ks"] = (0, *sorted(o["ks"]))
    if o["draft_ngram"] is None:
        o["draft_ngram"] = not (o["model"].startswith("random:") or o["drafter"] == "random")
    received: list[int] = []

    def terminated(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt  # as Ctrl-C: the rounds that finished are reported

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        path = run(BenchConfig(
            prompts=o["prompts"], out=o["out"], model=o["model"], drafter=o["drafter"],
            prompt_column=o["prompt_column"], messages_column=o["messages_column"],
            num_prompts=o["num_prompts"],
            chat_template=not o["no_chat_template"], batch_sizes=o["batch_sizes"], ks=o["ks"],
            draft_confidence=o["draft_confidence"], draft_int8=o["draft_int8"],
            q4_panels=o["q4_panels"], draft_max_batch=o["draft_max_batch"] or None,
            draft_ngram=o["draft_ngram"], draft_ngram_tokens=o["draft_ngram_tokens"],
            attention_backend=o["attention_backend"], cuda_graphs=o["cuda_graphs"],
            max_tokens=o["max_tokens"], baseline=o["baseline"], repeats=o["repeats"],
            ignore_eos=o["ignore_eos"], dtype=o["dtype"], device=o["device"],
            kv_cache_memory=o["kv_cache_memory"],
            max_num_batched_tokens=o["max_num_batched_tokens"], threads=o["threads"],
            ceiling=o["ceiling"], overwrite=o["overwrite"],
            prefix_caching=o["prefix_caching"]))
    except JobError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(_EXIT_USER_ERROR)
    except (BenchInterrupted, KeyboardInterrupt) as exc:
        for s in (signal.SIGINT, signal.SIGTERM):  # the process exits: no second interrupt
            signal.signal(s, signal.SIG_IGN)
        report = exc.report if isinstance(exc, BenchInterrupted) else None
        click.echo(f"interrupted: wrote {report} from the rounds that finished" if report else
                   "interrupted before a round finished: nothing written", err=True)
        sys.exit(128 + (received[0] if received else signal.SIGINT))
    finally:
        if signal.getsignal(signal.SIGTERM) is terminated:
            signal.signal(signal.SIGTERM, previous)
    click.echo(f"wrote {path}")


@click.command()
@click.argument("directory", metavar="OUTPUT_DIR", callback=not_blank)
@click.option("--out", default=None, callback=not_blank,
              help="Where report.md and the PNG plots go (default: OUTPUT_DIR).")
def report(directory: str, out: str | None) -> None:
    """Write report.md and PNG plots for a job's OUTPUT_DIR (from stats.parquet and
    manifest.json; finished or not), or redraw a bench's report from its bench.parquet."""
    from pipeline.bench.commands import report as run  # noqa: PLC0415

    try:
        path = run(ReportConfig(directory, out))
    except JobError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(_EXIT_USER_ERROR)
    click.echo(f"wrote {path}")

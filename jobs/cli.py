"""`eaglebatch` command line. Every option maps onto one field of JobConfig / EngineConfig."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import click

from jobs.generate_config import job_config
from jobs.options import (
    finite,
    json_schema,
    logit_bias,
    memory_size,
    not_blank,
    stop_strings,
    token_ids,
)
from pipeline.config import JobError
from pipeline.interrupt import JobInterrupted, rerun_hint
from runtime.config import (
    CLI_DRAFT_CONFIDENCE,
    CLI_DRAFT_MAX_BATCH,
    CLI_DRAFT_NGRAM_TOKENS,
    DEFAULT_MODEL,
    MAX_DRAFT_TOKENS,
    MAX_PENALTY,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    EngineConfig,
)

_EXIT_USER_ERROR = 2




@click.group()
def main() -> None:
    """eaglebatch: batch offline LLM generation, Parquet in, Parquet out."""


@main.command()
@click.argument("input", metavar="INPUT")
@click.argument("output_dir", metavar="OUTPUT_DIR")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, callback=not_blank,
              help="Built-in model name, or a Hugging Face checkpoint directory or .gguf file "
                   "of a Llama, Qwen2, Qwen3 or Mistral model.")
@click.option("--drafter", default="auto", show_default=True, callback=not_blank,
              help="EAGLE drafter checkpoint directory for speculative decoding (EAGLE-1 or "
                   "EAGLE-3, any number of layers; the EAGLE, SGLang and speculators layouts); "
                   "'none' to decode without one; 'auto' uses the model's default drafter when "
                   "one ships (the built-in model's), else none.")
@click.option("--num-speculative-tokens", "--k", "num_speculative_tokens", default=2,
              show_default=True, type=click.IntRange(1, MAX_DRAFT_TOKENS),
              help="Draft tokens proposed per step when a drafter is used, k (2 measured best "
                   "for the shipped drafter on CPU; see its model card). --k is the same "
                   "option, by the name `eaglebatch bench` gives it.")
@click.option("--draft-confidence", default=CLI_DRAFT_CONFIDENCE, show_default=True,
              type=click.FloatRange(0, 1, max_open=True), callback=finite,
              help="Cut a request's drafts where the drafter's probability of the drafts so far "
                   "falls below this, so less is spent verifying likely rejects, and stop "
                   "drafting once every request's has; 0 always drafts --num-speculative-tokens. "
                   "A greedy request alone in its step still verifies the draft that fell below "
                   "(its extra rows cost almost nothing), but no more are drafted after it. "
                   "Greedy outputs are the same either way.")
@click.option("--draft-max-batch", default=None, type=click.IntRange(0),
              show_default=f"{CLI_DRAFT_MAX_BATCH}, or 1 with --q4-panels",
              help="Requests get no drafts in steps with more than this many requests "
                   "(on the CPU verifying drafts costs more than it saves at larger batches: "
                   "the shipped drafter gains 1.5-1.6x at batch 1, 1.1-1.2x at 4, under 1.0x "
                   "at 16 for greedy requests; requests sampling at temperature 0.7-1 gain "
                   "1.25-1.45x alone but lose 5-15% in a job of --max-num-seqs 4; with "
                   "--q4-panels 1.2x at batch 1 and 0.9x at 4); such steps skip "
                   "the drafter, which catches up when the batch drains. 0: draft at any "
                   "batch. Outputs are the same either way.")
@click.option("--draft-ngram/--no-draft-ngram", default=True, show_default=True,
              help="Where a request's last 2-4 tokens occurred before in its prompt or output, "
                   "draft the tokens that followed them instead of the drafter's drafts (cheap, "
                   "often right where answers repeat); needs a drafter (with --drafter none, "
                   "or a model without a shipped one under 'auto', nothing is drafted). "
                   "Outputs are the same either way.")
@click.option("--draft-ngram-tokens", default=CLI_DRAFT_NGRAM_TOKENS, show_default=True,
              type=click.IntRange(0),
              help="With --draft-ngram, a greedy request alone in its step may take up to this "
                   "many lookup drafts, more than --num-speculative-tokens (its verification "
                   "reads the weights once for a few rows: on the CPU up to 4 rows cost it "
                   "almost nothing); 0 or at most k: k. Outputs are the same either way.")
@click.option("--draft-int8/--no-draft-int8", default=True, show_default=True,
              help="On the CPU, run the drafter on int8 copies of its weights (one scale per "
                   "output): a draft step reads a quarter of the bytes of float32. Drafts may "
                   "differ slightly; outputs are the same either way (verification decides).")
@click.option("--q4-panels/--no-q4-panels", default=False, show_default=True,
              help="On the CPU, products of up to 12 rows (small batches) read 4-bit copies of "
                   "the model's weights where every weight is exactly a GGUF Q4_1 value (the "
                   "default model's decoder): the same bits, 3/16 of the bytes; batch-1 "
                   "decoding ~1.8x faster, though drafting then gains less. Outputs are the "
                   "same either way.")
@click.option("--attention-backend", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "cpu", "flash"]),
              help="auto: flash-attn on CUDA when installed, the C++ paged kernel on CPU when it "
                   "builds, else torch (portable, gathers K/V then runs SDPA).")
@click.option("--cuda-graphs/--no-cuda-graphs", default=False, show_default=True,
              help="On CUDA with --attention-backend torch: replay decode steps (one token per "
                   "request, no drafts) from CUDA graphs, one per bucket of batch size and "
                   "context length, instead of launching every kernel from Python. Not yet "
                   "measured on a GPU, hence off.")
@click.option("--prompt-column", default="prompt", show_default=True,
              help="Input column holding the prompt text (string).")
@click.option("--id-column", default="id", show_default=True, callback=not_blank,
              help="Input column of unique row ids (string or integer). If the input has no such "
                   "column, ids '<file stem>:<row index>' are made and written to it (for files "
                   "in Hive partition folders, '<path under INPUT without .parquet>:<row "
                   "index>', e.g. 'lang=en/part-0:0').")
@click.option("--messages-column", default=None,
              help="Input column of chat messages, list<struct<role, content>>, used instead of "
                   "--prompt-column and rendered with the model's chat template.")
@click.option("--output-prefix", default="", show_default=False,
              help="Put this before the names of the columns the job adds, e.g. judge_ gives "
                   "judge_completion, judge_finish_reason, ... (default: none). Lets a job "
                   "read another job's outputs, whose columns have the plain names: INPUT "
                   "may then be that job's OUTPUT_DIR, with --prompt-column completion.")
@click.option("--no-chat-template", "no_chat_template", is_flag=True,
              help="Tokenize prompts as raw text instead of wrapping them in the model's chat "
                   "template as a user message.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1),
              help="Most tokens generated per row (lowered per row to fit the model's context; "
                   "an input column max_tokens overrides it per row).")
@click.option("--min-tokens", default=0, show_default=True, type=click.IntRange(0),
              help="Hold the EOS token and --stop-token-ids back until a row has this many "
                   "tokens (as transformers' min_new_tokens), and stop strings too: only one that "
                   "ends after those tokens' text stops the row, and the text is cut there (as "
                   "vLLM's min_tokens). A min_tokens column overrides it.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0),
              callback=finite,
              help="Sampling temperature; 0 (or anything below 1e-5) means greedy. A "
                   "temperature column overrides it.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              callback=finite,
              help="Nucleus sampling: keep the smallest set of tokens whose probability reaches "
                   "this (1 = off). A top_p column overrides it.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0, MAX_TOP_K),
              help="Sample among the k most likely tokens only (0 = off). A top_k column "
                   "overrides it.")
@click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              callback=finite,
              help="Drop the tokens less likely than this times the most likely one, after the "
                   "temperature (0 = off; as vLLM's min_p). A min_p column overrides it.")
@click.option("--repetition-penalty", default=1.0, show_default=True,
              type=click.FloatRange(*REPETITION_PENALTY_RANGE), callback=finite,
              help="Divide the logit of every token already in the prompt or the completion by "
                   "this where it is positive, multiply it where not (1 = off; above 1 "
                   "discourages repeats; as transformers' and vLLM's repetition_penalty). "
                   "Applies to greedy decoding too. A repetition_penalty column overrides it.")
@click.option("--frequency-penalty", default=0.0, show_default=True,
              type=click.FloatRange(-MAX_PENALTY, MAX_PENALTY), callback=finite,
              help="Subtract this times a token's count in the completion so far from its logit "
                   "(0 = off; as OpenAI's and vLLM's frequency_penalty). A frequency_penalty "
                   "column overrides it.")
@click.option("--presence-penalty", default=0.0, show_default=True,
              type=click.FloatRange(-MAX_PENALTY, MAX_PENALTY), callback=finite,
              help="Subtract this from the logit of every token that occurs in the completion "
                   "so far (0 = off; as OpenAI's and vLLM's presence_penalty). A "
                   "presence_penalty column overrides it.")
@click.option("--logprobs", is_flag=True,
              help="Also write completion_logprobs: each generated token's log-probability "
                   "under the model's own distribution (the log-softmax of its logits, before "
                   "penalties, temperature, min-p, top-k and top-p; as vLLM's default "
                   "logprobs), one "
                   "per completion_token_ids entry; in float32 on the CPU (with --attention-"
                   "backend auto's C++ kernel) the same with or without a drafter. Greedy rows "
                   "then compute the whole head.")
@click.option("--top-logprobs", default=0, show_default=True,
              type=click.IntRange(0, MAX_TOP_LOGPROBS), metavar="N",
              help="Also write completion_top_logprobs: for each generated token, the N most "
                   "likely tokens of the distribution it was drawn from, as (token_id, logprob) "
                   "structs, most likely first (the lowest id first among equal values): the "
                   "log-softmax of the raw logits, as --logprobs (vLLM's logprobs=N, OpenAI's "
                   "top_logprobs; data for distillation). 0 = off. The same with or without a "
                   "drafter as --logprobs. Greedy rows then compute the whole head.")
@click.option("--prompt-logprobs", is_flag=True,
              help="Also write prompt_logprobs: each prompt token's log-probability given the "
                   "tokens before it, one per prompt token (the first null), as vLLM's "
                   "prompt_logprobs: to score or filter text, with --max-tokens 1 and "
                   "--no-chat-template to score the text alone (else the chat template's "
                   "tokens are scored too). Such prompts are computed whole, without "
                   "prefix-cache hits; in float32 on the CPU (as --logprobs) the same bits "
                   "however a prompt is cut into chunks.")
@click.option("--seed", default=None, type=int,
              help="Random seed for sampling, so reruns draw the same tokens; each row draws "
                   "from its own seed, derived from this one and the row id (rows with the same "
                   "prompt get independent samples). A seed column overrides it for its row "
                   "and is used as given (with --n 1).")
@click.option("--stop", multiple=True, callback=stop_strings,
              help="Stop generating when this string appears in the text (may be given several "
                   "times); the completion is cut before it (see --include-stop-str-in-output "
                   "and --min-tokens). Special tokens are left out of the text, so their text "
                   "never matches: give their ids to --stop-token-ids. A stop column "
                   "(list<string>) overrides it.")
@click.option("--include-stop-str-in-output", is_flag=True,
              help="Keep the stop string at the end of the completion text instead of cutting "
                   "it off (vLLM's include_stop_str_in_output).")
@click.option("--stop-token-ids", default="", metavar="IDS",
              callback=token_ids,
              help="Comma-separated token ids that end a row as EOS does, kept as its last "
                   "token (vLLM's stop_token_ids; special tokens' text is left out of the "
                   "completion); also with --ignore-eos, and held back by --min-tokens. A "
                   "stop_token_ids column (list<integer>) overrides it.")
@click.option("--allowed-token-ids", default="", metavar="IDS", callback=token_ids,
              help="Comma-separated token ids: only these may be generated (vLLM's "
                   "allowed_token_ids: say, a classification's label tokens); the others' "
                   "logits are -inf. An allowed_token_ids column (list<integer>) overrides it.")
@click.option("--logit-bias", default="", metavar="ID:BIAS,...", callback=logit_bias,
              help="Add a bias in [-100, 100] to these tokens' logits, e.g. 17:2.5,90:-100 or "
                   "the JSON object {\"17\": 2.5, \"90\": -100} (OpenAI's and vLLM's "
                   "logit_bias: -100 bans a token, +100 all but forces it), before the "
                   "penalties. A logit_bias column (map<integer, number>) overrides it.")
@click.option("--guided-choice", multiple=True, metavar="TEXT",
              help="Repeatable: each completion is one of these strings, then EOS (vLLM's "
                   "guided_choice: labels for a classification job). Any way the tokenizer "
                   "can spell a choice is open to the model; drafts change no token. A "
                   "guided_choice column (list<string>) overrides it.")
@click.option("--guided-regex", default=None, metavar="PATTERN",
              help="Each completion matches this regular expression whole, then EOS (vLLM's "
                   "guided_regex; Python's syntax without backreferences, lookarounds or \\b; "
                   "\\d \\w \\s are ASCII): formats, IDs, simple JSON. A guided_regex column "
                   "(string) overrides it.")
@click.option("--guided-json", default=None, metavar="SCHEMA", callback=json_schema,
              help="Each completion is JSON that this JSON schema allows, written compactly, "
                   "then EOS (vLLM's guided_json): the schema's text, or a .json file holding "
                   "it. Objects keep the schema's property order; keywords a pattern cannot "
                   "hold (minimum, multipleOf, ...) are refused. A guided_json column (string) "
                   "overrides it.")
@click.option("--ignore-eos", is_flag=True,
              help="Do not end a row at the model's EOS tokens: generate until --max-tokens, a "
                   "stop string or a stop token id (vLLM's ignore_eos: synthetic load, fixed "
                   "lengths).")
@click.option("--n", "n", default=1, show_default=True, type=click.IntRange(1, 65536),
              help="Samples per prompt, written as n rows with a sample_index column; each gets "
                   "a seed derived from the seed, the row id and the sample index.")
@click.option("--shard-rows", default=10_000, show_default=True, type=click.IntRange(1),
              help="Input rows per shard; each shard is written and committed as one part file, "
                   "the unit of resume.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Model weights and compute dtype; auto is float32 on CPU, bfloat16 on GPU. "
                   "bfloat16 on a CPU with AMX is faster at large batches, but its rounding "
                   "depends on the batch: float32 on the CPU gives the same tokens at any "
                   "batch size, with or without drafting.")
@click.option("--device", default="auto", show_default=True,
              type=click.Choice(["auto", "cpu", "cuda"]),
              help="Where the model runs; auto picks cuda when available.")
@click.option("--kv-cache-memory", default=None, callback=memory_size,
              help="Memory for the paged KV cache, e.g. 2GiB or 512MiB (default: 1 GiB on CPU, "
                   "a fraction of free memory on GPU).")
@click.option("--max-model-len", default=None, type=click.IntRange(2),
              help="Longest a request may grow, prompt and completion together (a longer "
                   "prompt is an error row; --max-tokens is clamped to fit). Default: the "
                   "model's context as vLLM derives it: max_position_embeddings (times a "
                   "linear RoPE scaling's factor), or a yarn scaling's original context times "
                   "its factor.")
@click.option("--max-num-batched-tokens", default=EngineConfig.max_num_batched_tokens,
              show_default=True, type=click.IntRange(1),
              help="Token budget of one engine step (prefill chunks + decode tokens).")
@click.option("--max-num-seqs", default=EngineConfig.max_num_seqs, show_default=True,
              type=click.IntRange(1), help="Most requests running at once.")
@click.option("--block-size", default=EngineConfig.block_size, show_default=True,
              type=click.IntRange(1), help="Tokens per KV cache block.")
@click.option("--threads", default=None, type=click.IntRange(1, 1024),
              help="torch CPU threads (default: torch's choice). On a busy machine fewer "
                   "threads than cores is often much faster.")
@click.option("--overwrite", is_flag=True,
              help="Delete this job's earlier outputs in OUTPUT_DIR (part files, stats, manifest, "
                   "and a report of them written there) instead of resuming; needed when the "
                   "options or the input changed.")
@click.option("--runner", default="local", show_default=True, type=click.Choice(["local", "ray"]),
              help="local: one engine in this process. ray: one engine per Ray worker, shards "
                   "spread over the workers (needs the ray extra). Output and resume are the same "
                   "either way: a job started on one runner can be finished on the other.")
@click.option("--num-workers", default=None, type=click.IntRange(1),
              help="Ray workers (engines) [default: one per GPU for GPU workers, else 1].")
@click.option("--ray-address", default=None,
              help="Ray cluster to join: HOST:PORT, or 'auto' for the one in RAY_ADDRESS or "
                   "started by `ray start` on this machine [default: start a local Ray instance "
                   "sized to this machine, stopped when the job ends].")
@click.option("--gpus-per-worker", default=None, type=click.FloatRange(0), callback=finite,
              help="GPUs each Ray worker reserves, e.g. 1 or 0.5 [default: 1 when the cluster "
                   "has GPUs and --device is not cpu, else 0: CPU workers, which split the "
                   "cluster's CPUs between them, at least one each].")
def generate(**options: Any) -> None:
    """Generate a completion for every row of INPUT (a Parquet file, a directory of Parquet files
    at its top or in Hive partition folders such as lang=en/, whose values become columns, or a
    glob) into OUTPUT_DIR/part-NNNNN.parquet, with stats.parquet and manifest.json. Rerunning
    the same command resumes an interrupted job."""
    from pipeline.job import run_job  # `--help` needs no torch
    from pipeline.manifest import SUCCESS_FILE  # noqa: PLC0415

    overwrite = bool(options.get("overwrite"))
    received: list[int] = []
    started = time.time() - 0.1  # file times come from a coarser clock (a tick behind)
    success = os.path.join(str(options.get("output_dir")), SUCCESS_FILE)

    def terminated(signum: int, frame: object) -> None:
        if _written_since(success, started):  # the job is complete: nothing to stop
            return
        received.append(signum)
        raise KeyboardInterrupt  # not an Exception, which library code may catch and go on

    # Ctrl-C and SIGTERM outside the shards' loop (loading inputs or the model; the moment
    # between writing _SUCCESS and the return), the shards' loop having its own handlers
    previous = {s: signal.signal(s, terminated) for s in (signal.SIGINT, signal.SIGTERM)}
    exiting = False  # on an interrupt: further signals are ignored while the process exits
    try:
        config = job_config(options)
        summary = run_job(config)
        # the job is done (or stopped by a failure it reports): a signal while the process
        # exits would only turn its exit status into a kill's
        exiting = _ignore_signals()
    except JobError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(_EXIT_USER_ERROR)
    except JobInterrupted as exc:
        exiting = _ignore_signals()  # a second one raised in objects' __del__ or killed it
        click.echo(str(exc), err=True)
        sys.exit(128 + exc.signum)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM outside the shards' loop
        exiting = _ignore_signals()
        click.echo(f"interrupted; the shards committed so far are kept: "
                   f"{rerun_hint(overwrite)}", err=True)
        sys.exit(128 + (received[0] if received else signal.SIGINT))
    finally:
        if not exiting:
            for s, handler in previous.items():
                signal.signal(s, handler)
    engine = config.engine
    if (engine.drafter and summary.shards_run and not summary.totals.drafted
            and summary.totals.rows > summary.totals.errors):
        limit = engine.draft_max_batch
        why = [] if limit is None else [
            f"requests draft only in steps of at most {limit} "
            f"request{'' if limit == 1 else 's'} (--draft-max-batch)"]
        if engine.draft_confidence > 0:
            why.append(f"a request's drafts stop where the drafter's confidence falls below "
                       f"{engine.draft_confidence:g} (--draft-confidence)")
        if why:
            click.echo(f"note: nothing was drafted: {'; '.join(why)}", err=True)


def _written_since(path: str, since: float) -> bool:
    try:
        return os.path.getmtime(path) >= since
    except OSError:
        return False


def _ignore_signals() -> bool:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    return True


from jobs.bench import bench, report  # noqa: E402  (registered once main exists)

main.add_command(bench)
main.add_command(report)

from jobs.train_drafter import train_drafter  # noqa: E402

main.add_command(train_drafter)

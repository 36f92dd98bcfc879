"""Where a decode step's time goes, without and with the drafter.

Runs the same prompts through two engines that share the target's weights (k = 0, and the
drafter at k = K). At batch 1 (the default) they take one prompt each in turn, so that a drift
of the machine's speed hits both alike; at `--batch-size B` each engine takes all the prompts,
B at a time, drafting in every step (as `eaglebatch bench` does), and the two alternate over
`--repeats` runs. It times the parts of every decode step (steps that feed prompt tokens are
left out):

- target: the target model's forward over the step's rows (1 without drafts, 1 + drafts with);
- head + verify: the LM head's argmax (the exact greedy head) and the draft verification;
- proposing: everything the proposer does (drafter forwards, its head, lookups, metadata);
- rest: the engine's own work around them (scheduling, inputs, appending tokens).

It prints the medians per decode step and the ratio the parts imply, tokens per step over the
drafted step's cost relative to the plain one (what `eaglebatch bench` measures end to end), and
the same ratio with drafting free (no proposing). It also counts the target's rows per decode
step and sets what each extra row costs against this machine's float32 arithmetic: the decoder's
products take 2 x (its Linear weights) floating-point operations a row, and a large matrix product
(torch.mm, 2048 x 2048, the same threads) shows how many of those the machine does in a second.
Where an extra row costs about what that rate allows, verification's rows are bound by arithmetic,
and no engine work makes them cheaper:

    PYTHONPATH=. python benchmarks/step_breakdown.py --num-prompts 8 --k 2 --threads 2
    PYTHONPATH=. python benchmarks/step_breakdown.py --num-prompts 16 --batch-size 16 --repeats 3
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from pipeline.bench.engine_run import engine_config
from pipeline.bench.workload import build_workload, read_prompts
from runtime.config import CLI_DRAFT_CONFIDENCE, CLI_DRAFT_NGRAM_TOKENS, DEFAULT_MODEL, EngineConfig
from runtime.engine import Engine
from runtime.loader import default_drafter, load_model_config, load_tokenizer, resolve_model
from runtime.model_runner import RunnerOutput
from runtime.scheduler import SchedulerOutput

PARTS = ("target", "head + verify", "proposing", "rest")


class StepTimer:
    """Wraps an engine's step, its runner's target forward, sampling and proposer (instance
    attributes, so the engine's code runs unchanged) and keeps each decode step's parts in ms."""

    active: StepTimer | None = None  # the timer whose engine runs a step (they share the model)

    def __init__(self, engine: Engine) -> None:
        self.steps: list[dict[str, float]] = []
        self.tokens = 0
        self.rows: list[int] = []  # the target's rows in each decode step
        self._rows = 0
        self._current: dict[str, float] = {}
        self._decode = False  # whether the step being run feeds no prompt token
        runner = engine.runner
        _time_forwards(runner.model)
        execute = runner.execute

        def noting_decode(out: SchedulerOutput, block_tables: list[list[int]]) -> RunnerOutput:
            self._decode = all(start >= seq.num_prompt_tokens for seq, start, _ in out.scheduled)
            return execute(out, block_tables)

        runner.execute = noting_decode  # type: ignore[method-assign]
        runner._sample = self._wrap("head + verify", runner._sample)  # type: ignore[method-assign]
        if runner.proposer is not None:
            proposer = runner.proposer
            proposer.propose = self._wrap("proposing", proposer.propose)  # type: ignore[method-assign]
        step = engine.step

        def timed_step(on_step: Callable[[int], None] | None = None) -> Any:
            self._current = dict.fromkeys(PARTS[:-1], 0.0)
            self._rows = 0
            generated = [0]
            StepTimer.active = self
            start = time.perf_counter()
            finished = step(lambda n: generated.__setitem__(0, n))
            total = (time.perf_counter() - start) * 1e3
            if on_step is not None:
                on_step(generated[0])
            if self._decode:
                self._current["rest"] = total - sum(self._current.values())
                self.steps.append(self._current)
                self.rows.append(self._rows)
                self.tokens += generated[0]
            return finished

        engine.step = timed_step  # type: ignore[method-assign]

    def _wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self._timed(part, fn, *args, **kwargs)

    def _timed(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self._current[part] = self._current.get(part, 0.0) + (time.perf_counter() - start) * 1e3
        return result

    def medians(self) -> dict[str, float]:
        parts = {p: statistics.median(s[p] for s in self.steps) for p in PARTS}
        parts["step"] = statistics.median(sum(s.values()) for s in self.steps)
        parts["step (mean)"] = statistics.fmean(sum(s.values()) for s in self.steps)
        return parts


def decoder_flops_per_row(model_dir: Path) -> int:
    """Floating-point operations of the decoder's products for one row (token): 2 per weight of
    its Linear layers (attention's q, k, v, o and the MLP's three), the LM head left out."""
    c = load_model_config(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = c.hidden_size * head_dim * 2 * (c.num_attention_heads + c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return 2 * c.num_hidden_layers * (attention + mlp)


def matmul_rate(size: int = 2048, runs: int = 10) -> float:
    """This machine's float32 operations per second in one large torch.mm (the current threads):
    what its arithmetic does when nothing else limits it."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(runs):
        torch.mm(a, b)
    return 2 * size ** 3 * runs / (time.perf_counter() - start)


def _time_forwards(model: torch.nn.Module) -> None:
    """Times the target's forwards for the active timer (once per model: engines share it)."""
    if "forward" in vars(model):
        return
    original = model.forward

    def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        timer = StepTimer.active
        assert timer is not None
        timer._rows += input_ids.numel()
        return timer._timed("target", original, input_ids, *args, **kwargs)

    model.forward = forward


@click.command()
@click.option("--prompts", default="examples/prompts.parquet", show_default=True,
              help="Parquet file of prompts (column 'prompt').")
@click.option("--num-prompts", default=8, show_default=True, help="Use the first N prompts.")
@click.option("--k", default=2, show_default=True, help="Draft tokens per step of the drafter.")
@click.option("--drafter", default="auto", show_default=True,
              help="Drafter directory; 'auto': the one shipped for the default model.")
@click.option("--max-tokens", default=128, show_default=True, help="New tokens per prompt.")
@click.option("--threads", default=None, type=int, help="torch threads (default: torch's).")
@click.option("--batch-size", default=1, show_default=True,
              help="Requests per step (the engines' --max-num-seqs); above 1 the drafter drafts "
                   "in every step.")
@click.option("--repeats", default=3, show_default=True,
              help="Runs of all the prompts per engine when --batch-size is above 1.")
def main(prompts: str, num_prompts: int, k: int, drafter: str, max_tokens: int,
         threads: int | None, batch_size: int, repeats: int) -> None:
    if threads:
        torch.set_num_threads(threads)
    model_dir = resolve_model(DEFAULT_MODEL)
    drafter_dir = default_drafter(DEFAULT_MODEL) if drafter == "auto" else Path(drafter)
    if drafter_dir is None:
        raise click.BadParameter("no drafter is shipped for the default model",
                                 param_hint="--drafter")
    tokenizer = load_tokenizer(model_dir)
    workload = build_workload(read_prompts(prompts, "prompt", num_prompts), "prompt", None,
                              tokenizer, 2048, max_tokens, True, False)
    # the engines `eaglebatch bench` builds, with its defaults (draft_max_batch None: drafts in
    # every step)
    base = EngineConfig(kv_cache_memory=1 << 28, draft_int8=True, draft_ngram=True,
                        draft_ngram_tokens=CLI_DRAFT_NGRAM_TOKENS,
                        draft_confidence=CLI_DRAFT_CONFIDENCE)
    plain = Engine(engine_config(model_dir, None, 0, batch_size, workload, base))
    drafted = Engine(engine_config(model_dir, drafter_dir, k, batch_size, workload, base),
                     plain.model)
    requests = workload.requests()
    for engine in (plain, drafted):  # warm-up, untimed
        list(engine.generate(requests[:batch_size]))
    timers = [StepTimer(plain), StepTimer(drafted)]
    outputs: list[list[tuple[int, ...]]] = [[], []]
    if batch_size == 1:
        for request in requests:
            for i, engine in enumerate((plain, drafted)):
                outputs[i] += [c.token_ids for c in engine.generate([request])]
    else:
        for _ in range(repeats):
            for i, engine in enumerate((plain, drafted)):
                engine.reset_prefix_cache()
                done = {c.request_id: c.token_ids for c in engine.generate(requests)}
                outputs[i] = [done[r.request_id] for r in requests]
    same = outputs[0] == outputs[1]
    (p, p_tokens), (d, d_tokens) = ((t.medians(), t.tokens / len(t.steps)) for t in timers)
    print(f"{len(requests)} prompts, {sum(map(len, outputs[0]))} tokens, outputs equal: {same}")
    print(f"| part (ms per decode step, median) | k=0 | k={k} | difference |")
    print("| --- | ---: | ---: | ---: |")
    for part in (*PARTS, "step", "step (mean)"):
        print(f"| {part} | {p[part]:.2f} | {d[part]:.2f} | {d[part] - p[part]:+.2f} |")
    gain = d_tokens / p_tokens
    print(f"tokens per decode step: {p_tokens:.3f} / {d_tokens:.3f}; implied speedup "
          f"{gain * p['step'] / d['step']:.2f}x (means: "
          f"{gain * p['step (mean)'] / d['step (mean)']:.2f}x); with drafting free (no "
          f"proposing): {gain * p['step'] / (d['step'] - d['proposing']):.2f}x")
    flops = decoder_flops_per_row(model_dir)
    rate = matmul_rate()
    p_rows, d_rows = (statistics.fmean(t.rows) for t in timers)
    print(f"target rows per decode step: {p_rows:.2f} / {d_rows:.2f}; decoder products "
          f"{flops / 1e6:.0f} MFLOP a row; torch.mm 2048 x 2048: {rate / 1e9:.0f} GFLOP/s")
    for name, parts, rows in (("k=0", p, p_rows), (f"k={k}", d, d_rows)):
        print(f"  {name}: target forward at {flops * rows / (parts['target'] * 1e-3) / 1e9:.0f} "
              f"GFLOP/s ({flops * rows / (parts['target'] * 1e-3) / rate:.0%} of torch.mm's)")
    if d_rows > p_rows:
        extra = (d["target"] - p["target"]) / (d_rows - p_rows)
        print(f"  each extra row: {extra:.3f} ms; at torch.mm's rate it would take "
              f"{flops / rate * 1e3:.3f} ms")


if __name__ == "__main__":
    main()

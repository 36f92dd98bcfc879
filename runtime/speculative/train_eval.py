"""Measuring a trained drafter with the real engine, and writing its model card."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from runtime.config import EngineConfig, SamplingParams
from runtime.request import GenerationRequest
from runtime.speculative.train_data import Prompt, render_prompts

if TYPE_CHECKING:
    from runtime.speculative.train_job import TrainDrafterJob


class EvalResult(NamedTuple):
    num_prompts: int
    num_tokens: int
    drafted: int
    accepted: int
    draft_steps: int
    per_position: list[float]  # accepted at position j / draft steps
    seconds: float

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / max(1, self.draft_steps)

    def summary(self) -> str:
        per = ", ".join(f"{p:.3f}" for p in self.per_position)
        return (f"evaluation on {self.num_prompts} held-out prompts ({self.num_tokens} tokens, "
                f"{self.seconds:.0f} s): acceptance rate {self.acceptance_rate:.3f}, mean "
                f"acceptance length {self.mean_acceptance_length:.3f}, per position [{per}]")


def evaluate(model: str, drafter: Path, prompts: Sequence[Prompt], k: int, max_tokens: int,
             dtype: str = "float32", max_model_len: int = 2048) -> EvalResult:
    """Greedy generation with our engine and the drafter; acceptance as vLLM reports it. A
    prompt the engine cannot run (too long for max_model_len, a chat its template refuses) is
    not counted; an answer stops
    at the context's end, as in `generate`."""
    from runtime.engine import Engine  # noqa: PLC0415

    engine = Engine(EngineConfig(model=model, dtype=dtype, drafter=str(drafter),
                                 num_speculative_tokens=k, max_model_len=max_model_len))
    ids = render_prompts(prompts, engine.tokenizer)
    started = time.perf_counter()
    tokens = drafted = accepted = steps = evaluated = 0
    per = [0] * k
    for c in engine.generate(GenerationRequest(str(i), tuple(t), SamplingParams(
            max_tokens=min(max_tokens, max(1, engine.max_model_len - len(t)))))
                             for i, t in enumerate(ids) if not isinstance(t, str)):
        if c.finish_reason == "error":
            continue
        evaluated += 1
        tokens += len(c.token_ids)
        drafted += c.num_drafted
        accepted += c.num_accepted
        steps += c.num_draft_steps
        for j, a in enumerate(c.accepted_per_position):
            per[j] += a
    return EvalResult(evaluated, tokens, drafted, accepted, steps,
                      [a / max(1, steps) for a in per], time.perf_counter() - started)


def write_model_card(job: TrainDrafterJob, num_sequences: int, num_answer_tokens: int,
                     steps: int, wall_s: float, log: list[dict[str, float]],
                     result: EvalResult | None, train_s: float = 0.0, kept: int = 0,
                     draft_vocab: int | None = None,
                     earlier_runs: Sequence[dict[str, Any]] = (), added: int | None = None
                     ) -> Path:
    """kept: answers in the data directory that this job's plan does not name (made by an
    earlier run with other samples, and trained on too), described by `earlier_runs` (the runs
    data/source.json recorded before this one). added: the answers this run made (None: not
    said); where it made none, the answers are described by the runs that made them, not by
    this run's answer options."""
    last = log[-20:]
    acc = {key: sum(r[key] for r in last) / len(last)
           for key in (last[0] if last else {}) if key.startswith("acc")}
    measured = (result.summary() if result is not None else "not evaluated (no --eval-prompts)")
    token_loss = (f"token-loss weight {job.train.ce_weight}, " if job.style == "eagle1" else "")
    recent = ("no steps" if not last else "the last step" if len(last) == 1
              else f"last {len(last)} steps")
    card = f"""# EAGLE drafter for `{job.model}`

Made by `eaglebatch train-drafter`. Load it with `eaglebatch generate --drafter <this dir>`.

- Target: `{job.model}` (its embedding is shared, not stored here)
- Draft head: {head_line(job, draft_vocab)}
- Style: {job.style}, {plural(job.num_layers, "decoder layer")}, trained with k =
  {job.train.num_steps} unrolled draft steps; weights stored as {job.save_dtype}
- Data: {num_sequences} answers ({num_answer_tokens} tokens) that the target generated itself with
  our engine ({made_line(job, added, earlier_runs)}) for
  the prompts in `{job.prompts_source}`: {answers_line(job, kept, earlier_runs, added)}; features
  from one teacher-forced pass of the target ({job.feature_dtype or job.data_dtype}) over
  prompt + answer
- Initialisation: {init_line(job)}
- Training: {plural(steps, "step")} ({train_s / 60:.1f} min of training in all runs), AdamW lr
  {job.train.lr}, warm-up {job.train.warmup_steps} steps then cosine,
  {job.train.batch_tokens} padded tokens per batch, grad clip {job.train.grad_clip},
  {token_loss}step decay {job.train.step_decay}
- Wall time of this run of the job: {wall_s / 60:.1f} min
- Training accuracy ({recent}, per unrolled step): {json.dumps(
        {k: round(v, 3) for k, v in acc.items()})}
- Measured (greedy, k = {job.num_speculative_tokens}, fp32, max {job.eval_max_tokens} tokens; the
  drafter alone: every step drafts k tokens, at every batch size, with no confidence cut and no
  lookup drafts, as `generate --draft-confidence 0 --no-draft-ngram --draft-max-batch 0
  --no-draft-int8` runs it; `generate`'s defaults draft less):
  {measured}
"""
    path = job.out_dir / "README.md"
    path.write_text(card)
    return path


def write_train_log(out_dir: Path, log: list[dict[str, float]]) -> None:
    """train_log.json: the loss and accuracy of (up to 200 evenly spaced) steps of every run."""
    (out_dir / "train_log.json").write_text(json.dumps(_thin(log)) + "\n")


def read_train_log(path: Path) -> list[dict[str, float]]:
    """An earlier run's train_log.json, which a resumed run extends; ValueError naming the file
    where it is not a list of steps (JSON objects)."""
    try:
        log = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--resume: {path} is not this training's log ({exc}); "
                         "remove it to start a new one") from None
    if not isinstance(log, list) or not all(isinstance(step, dict) for step in log):
        raise ValueError(f"--resume: {path} is not this training's log (not a list of steps); "
                         "remove it to start a new one")
    return log


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def made_line(job: TrainDrafterJob, added: int | None,
              earlier_runs: Sequence[dict[str, Any]]) -> str:
    """How the answers were made: with this run's options, or, where it made none (a rerun that
    reused them all), with those of the runs that did (data/source.json)."""
    made = sorted({(r.get("max_answer_tokens"), r.get("data_dtype")) for r in earlier_runs
                   if r.get("max_answer_tokens")}, key=str)
    if added == 0 and made:
        return "chat template; made by earlier runs of the job, " + " / ".join(
            f"at most {m} tokens, target in {d}" for m, d in made)
    return f"chat template, at most {job.max_answer_tokens} tokens, target in {job.data_dtype}"


def answers_line(job: TrainDrafterJob, kept: int = 0,
                 earlier_runs: Sequence[dict[str, Any]] = (), added: int | None = None) -> str:
    line = "its greedy answer to each"
    if job.answer_samples:
        temperatures = sorted({r["answer_temperature"] for r in earlier_runs
                               if r.get("answer_temperature") is not None})
        at = (" / ".join(map(str, temperatures)) if added == 0 and temperatures
              else job.answer_temperature)  # (reused answers: their runs' temperatures)
        line += f" and {job.answer_samples} sampled at temperature {at}"
        last = job.first_sample + job.answer_samples - 1
        if job.first_sample != 1:  # numbered only where they do not start at #1
            line += (f" (sample #{last})" if job.answer_samples == 1
                     else f" (samples #{job.first_sample}-#{last})")
    if kept:
        line += f", besides {kept} answers an earlier run left in the data directory"
        made = sorted({(r.get("max_answer_tokens"), r.get("data_dtype")) for r in earlier_runs
                       if r.get("max_answer_tokens")}, key=str)
        if made:
            line += " (made " + " / ".join(f"with at most {m} tokens in {d}"
                                           for m, d in made) + ")"
    return line


def init_line(job: TrainDrafterJob) -> str:
    if job.init_drafter is not None:
        return f"the weights of the drafter `{Path(job.init_drafter).name}` (fine-tuned from it)"
    return "draft layers copied from the target's last layers" if job.init_from_target else "random"


def head_line(job: TrainDrafterJob, draft_vocab: int | None = None) -> str:
    if job.style == "eagle1" and job.draft_head_size:
        return (f"its own, the target's LM head rows of the {job.draft_head_size} most frequent "
                "answer tokens, with d2t mapping draft ids to target ids")
    if job.style == "eagle3":
        size = draft_vocab or job.draft_vocab_size
        return f"its own norm + head over a draft vocabulary of the {size} most frequent tokens"
    return "the target's whole LM head (shared)"


def _thin(log: list[dict[str, Any]], keep: int = 200) -> list[dict[str, Any]]:
    stride = max(1, len(log) // keep)
    return log[::stride]

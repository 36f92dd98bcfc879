"""The train-drafter job: answers -> features -> training -> drafter checkpoint -> evaluation.

OUT_DIR ends up holding config.json + model.safetensors (the drafter, loadable with
EngineConfig(drafter=OUT_DIR)), README.md (model card), checkpoint.pt (resumable training state),
data/ (answers.jsonl and features shards, reused by --resume) and train_log.json.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from runtime.config import EngineConfig
from runtime.loader import (
    checkpoint_digest,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from runtime.speculative.checkpoint import drafter_config_dict
from runtime.speculative.loader import (
    default_aux_layer_ids,
)
from runtime.speculative.train_data import (
    ANSWERS,
    Prompt,
    answer_plan,
    build_feature_shards,
    check_answers_fit,
    check_source,
    feature_layers,
    generate_answers,
    read_answers,
    read_shard,
    read_source,
    record_source,
)
from runtime.speculative.train_eval import (
    EvalResult,
    evaluate,
    read_train_log,
    write_model_card,
    write_train_log,
)
from runtime.speculative.train_init import (
    build_drafter,
    draft_head,
    frequent_tokens,
    load_init_drafter,
    load_target,
    save_drafter,
    t2d_of,
)
from runtime.speculative.training import DrafterTrainer, TrainConfig, collate, make_batches


@dataclass(frozen=True)
class TrainDrafterJob:
    model: str
    prompt_ids: tuple[str, ...]
    prompts: tuple[Prompt, ...]  # strings, or chats (--messages-column)
    out_dir: Path
    train: TrainConfig
    num_layers: int = 2
    style: str = "eagle1"
    num_speculative_tokens: int = 3
    draft_vocab_size: int | None = None  # EAGLE-3: draft vocabulary; EAGLE-1: token-loss vocab
    draft_head_size: int | None = None  # EAGLE-1: own head of this many frequent tokens, + d2t
    max_answer_tokens: int = 128
    answer_samples: int = 0  # sampled answers per prompt, besides the greedy one
    answer_temperature: float = 0.7
    first_sample: int = 1  # number of the first sampled answer (#s1, #s2, ...)
    data_dtype: str = "bfloat16"  # dtype of the target while making answers (and features)
    feature_dtype: str | None = None  # the target's dtype in the features pass; None: data_dtype
    init_drafter: Path | None = None  # start from this drafter's weights (fine-tuning)
    save_dtype: str = "bfloat16"
    init_from_target: bool = True
    resume: bool = False
    eval_prompts: tuple[Prompt, ...] = ()
    eval_max_tokens: int = 128
    prompts_source: str = ""


def run_train_drafter(job: TrainDrafterJob) -> EvalResult | None:
    started = time.time()
    model_dir = resolve_model(job.model)
    target_config = load_model_config(model_dir)
    data_dir = job.out_dir / "data"
    ckpt = job.out_dir / "checkpoint.pt"
    # every check before hours of answers, not after
    if not job.resume and ckpt.exists():
        raise FileExistsError(f"{job.out_dir} holds a training checkpoint; pass --resume")
    drafter_files = [n for n in ("config.json", "model.safetensors")
                     if (job.out_dir / n).exists()]
    if drafter_files and not ckpt.exists():
        raise FileExistsError(f"{job.out_dir} holds a drafter ({', '.join(drafter_files)}) that "
                              "this job would replace; choose another --out, or remove them")
    card = job.out_dir / "README.md"  # the model card this job writes
    if card.is_file() and not card.read_text(errors="replace").startswith("# EAGLE drafter for "):
        raise FileExistsError(f"{card} is not a drafter's model card, and this job would "
                              "replace it; choose another --out, or remove it")
    log_file = job.out_dir / "train_log.json"
    if log_file.exists() and not ckpt.exists():  # this job writes one only with a checkpoint
        raise FileExistsError(f"{log_file} is not this training's log, and this job would "
                              "replace it; choose another --out, or remove it")
    earlier_log = read_train_log(log_file) if job.resume and ckpt.exists() else []
    if job.resume and ckpt.exists():
        check_resumable(ckpt, job)
    check_options(job, target_config)
    if job.init_drafter is not None:
        load_init_drafter(job.init_drafter, job.style, job.num_layers, target_config)
    aux = train_aux_layer_ids(target_config.num_hidden_layers)
    layers = feature_layers(job.style, aux)
    digest = checkpoint_digest(model_dir)  # data/source.json's target digest
    check_source(data_dir, job.model, digest, layers)
    check_answers_fit(data_dir, job.prompt_ids, job.prompts, load_tokenizer(model_dir))
    if read_source(data_dir) is None:  # named before the first answer: a run killed while
        record_source(data_dir, job.model, digest, layers, None)  # answering leaves it too
    answers_before = len(read_answers(data_dir / ANSWERS))
    engine_config = EngineConfig(model=job.model, dtype=job.data_dtype,
                                 max_model_len=min(2048, target_config.max_position_embeddings))
    planned = {a for a, _, _ in answer_plan(job.prompt_ids, job.answer_samples,
                                             job.first_sample)}
    with tqdm(total=len(planned), desc="answers", unit="seq") as bar:
        bar.update(sum(r["id"] in planned for r in read_answers(data_dir / ANSWERS)))
        generate_answers(engine_config, job.prompt_ids, job.prompts, data_dir,
                         job.max_answer_tokens, bar, job.answer_samples, job.answer_temperature,
                         job.first_sample)
    rows = read_answers(data_dir / ANSWERS)
    if not rows:  # (training would look for a first step forever)
        raise ValueError(f"no answers to train on: the target answered none of the "
                         f"{len(job.prompts)} prompt(s) (too long for its context of "
                         f"{engine_config.max_model_len} tokens, say: see the note above)")
    added = len(rows) - answers_before
    earlier_runs = record_source(data_dir, job.model, digest, layers, answers_run(job, added))
    with tqdm(total=len(rows), desc="features", unit="seq") as bar:
        shards = build_feature_shards(model_dir, data_dir, layers,
                                      dtype=getattr(torch, job.feature_dtype or job.data_dtype),
                                      progress=bar)
    target = load_target(model_dir, target_config)
    resumed = torch.load(ckpt, weights_only=False) if job.resume and ckpt.exists() else None
    vocab = resumed_vocab(resumed, job)
    if vocab is None:
        vocab = frequent_tokens(rows, job.draft_vocab_size or min(8192, target_config.vocab_size))
    drafter = build_drafter(target, job, vocab)
    trainer = DrafterTrainer(drafter, job.train, loss_vocab=vocab,
                             t2d=t2d_of(vocab, target_config.vocab_size))
    if resumed is not None:
        try:
            trainer.load_state(resumed)
        except (RuntimeError, ValueError, KeyError) as exc:  # another drafter's checkpoint
            raise ValueError(f"--resume: {ckpt} does not fit the drafter these options "
                             f"describe ({' '.join(str(exc).split())[:300]})") from None
    log = earlier_log
    try:
        log += train_loop(trainer, shards, ckpt)
    except TrainingInterrupted as stop:
        write_train_log(job.out_dir, log + stop.log)
        raise
    head: dict[str, torch.Tensor] = {}
    if job.style == "eagle1" and job.draft_head_size:
        head = draft_head(target, frequent_tokens(rows, job.draft_head_size))
    config = drafter_config_dict(target_config, job.num_layers, job.style,
                                 len(vocab) if job.style == "eagle3" else None,
                                 aux if job.style == "eagle3" else None)
    if head:
        config["draft_vocab_size"] = len(head["d2t"])
    save_drafter(job.out_dir, config, drafter, job.style, getattr(torch, job.save_dtype), head)
    result = None
    if job.eval_prompts:
        result = evaluate(job.model, job.out_dir, job.eval_prompts, job.num_speculative_tokens,
                          job.eval_max_tokens,
                          max_model_len=min(2048, target_config.max_position_embeddings))
        print(result.summary())
    write_model_card(job, len(rows), sum(len(r["answer_ids"]) for r in rows), trainer.step,
                     time.time() - started, log, result, trainer.elapsed_s,
                     kept=sum(r["id"] not in planned for r in rows), draft_vocab=len(vocab),
                     earlier_runs=earlier_runs, added=added)
    write_train_log(job.out_dir, log)
    return result


def resumed_vocab(resumed: dict[str, Any] | None, job: TrainDrafterJob
                  ) -> torch.Tensor | None:
    """An EAGLE-3 drafter's draft vocabulary on --resume: the one its checkpoint's head was
    trained over (its d2t), not the most frequent tokens of the answers now, which more data
    changes (a loss over other tokens than its head's trained it to nonsense; another
    --draft-vocab-size is refused before any work, by check_resumable)."""
    state = (resumed or {}).get("drafter", {})
    if job.style != "eagle3" or "d2t" not in state:
        return None
    d2t = state["d2t"]
    return torch.arange(len(d2t)) + d2t


class TrainingInterrupted(Exception):
    """Ctrl-C (SIGINT) during training; the checkpoint of the step reached is saved."""

    def __init__(self, step: int, log: list[dict[str, float]]) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.log = step, log


def check_options(job: TrainDrafterJob, target_config: Any) -> None:
    """Options that do not fit the target or each other (ValueError naming the option)."""
    vocab_size = target_config.vocab_size
    for option, size in (("--draft-vocab-size", job.draft_vocab_size),
                         ("--draft-head-size", job.draft_head_size)):
        if size is not None and size > vocab_size:
            raise ValueError(f"{option} {size} is larger than the target's vocabulary "
                             f"({vocab_size} tokens)")
    if job.draft_head_size is not None and job.style != "eagle1":
        raise ValueError("--draft-head-size is for --style eagle1; an EAGLE-3 drafter has its "
                         "own head over its draft vocabulary (--draft-vocab-size)")
    target_layers = target_config.num_hidden_layers
    if job.init_drafter is None and job.init_from_target and job.num_layers > target_layers:
        raise ValueError(f"--layers {job.num_layers} is more than the target's {target_layers} "
                         "layers (the drafter's layers start as copies of the target's last "
                         "ones)")


def answers_run(job: TrainDrafterJob, added: int) -> dict[str, Any] | None:
    """This run's entry in data/source.json, where it added answers."""
    if not added:
        return None
    return {"prompts": job.prompts_source, "answers": added,
            "max_answer_tokens": job.max_answer_tokens, "data_dtype": job.data_dtype,
            "answer_samples": job.answer_samples, "first_sample": job.first_sample,
            "answer_temperature": job.answer_temperature if job.answer_samples else None}


def train_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs feed an EAGLE-3 drafter: the usual (2, L/2, L-3), or on
    a target of fewer than 6 layers (where those do not fit) its first, middle and last."""
    if num_layers >= 6:
        return default_aux_layer_ids(num_layers)
    return (0, num_layers // 2, num_layers - 1)


def check_resumable(ckpt: Path, job: TrainDrafterJob) -> None:
    """--resume with a checkpoint of another drafter (layers, style) is refused before the
    answers and features are made again."""
    try:
        state = torch.load(ckpt, weights_only=False, map_location="cpu")["drafter"]
    except Exception as exc:  # a damaged checkpoint: torch raises many kinds
        raise ValueError(f"--resume: cannot read {ckpt} ({' '.join(str(exc).split())[:200]})"
                         ) from None
    layers = len({k.split(".")[1] for k in state if k.startswith("layers.")})
    out_size, in_size = state["fc.weight"].shape
    style = "eagle3" if in_size == 3 * out_size else "eagle1"
    if (layers, style) != (job.num_layers, job.style):
        raise ValueError(f"--resume: {ckpt} holds a {layers}-layer {style} drafter, but the "
                         f"options ask for --layers {job.num_layers} --style {job.style}")
    d2t = state.get("d2t")
    if (style == "eagle3" and d2t is not None and job.draft_vocab_size is not None
            and job.draft_vocab_size != len(d2t)):  # (resumed_vocab keeps the checkpoint's)
        raise ValueError(f"--draft-vocab-size {job.draft_vocab_size}: {ckpt} was trained over a "
                         f"draft vocabulary of {len(d2t)} tokens, which --resume keeps")


def train_loop(trainer: DrafterTrainer, shards: list[Path], ckpt: Path,
               every: int = 50, every_s: float = 300.0) -> list[dict[str, float]]:
    """Epochs over the shards until the step/time budget is spent; data order depends only on
    (seed, epoch), so a resumed run skips the batches it already trained on. A checkpoint is
    saved every `every` steps or `every_s` seconds, at the end, and on Ctrl-C (then
    TrainingInterrupted is raised)."""
    log: list[dict[str, float]] = []
    bar = tqdm(initial=trainer.step, total=trainer.config.max_steps, desc="train", unit="step")
    try:
        _train_epochs(trainer, shards, ckpt, every, every_s, bar, log)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    bar.close()
    save_checkpoint(trainer, ckpt)
    if interrupted:
        raise TrainingInterrupted(trainer.step, log)
    return log


def _train_epochs(trainer: DrafterTrainer, shards: list[Path], ckpt: Path, every: int,
                  every_s: float, bar: tqdm, log: list[dict[str, float]]) -> None:
    seen = 0
    saved = time.monotonic()
    epoch = 0
    while not trainer.done():
        g = torch.Generator().manual_seed(trainer.config.seed * 1000 + epoch)
        batches = seen
        for s in torch.randperm(len(shards), generator=g).tolist():
            shard = read_shard(shards[s])
            for seqs in make_batches(shard, trainer.config.batch_tokens, g):
                seen += 1
                if seen <= trainer.step:
                    continue
                m = trainer.train_step(collate(shard, seqs))
                acc = " ".join(f"{a:.2f}" for a in m.accuracy)
                bar.set_postfix_str(f"loss {m.loss:.3f} acc {acc} lr {trainer.learning_rate():.1e}")
                bar.update(1)
                log.append({"step": trainer.step, "loss": m.loss, "s": trainer.elapsed_s,
                            **{f"acc{j}": a for j, a in enumerate(m.accuracy)}})
                if trainer.step % every == 0 or time.monotonic() - saved > every_s:
                    save_checkpoint(trainer, ckpt)
                    saved = time.monotonic()
                if trainer.done():
                    break
            if trainer.done():
                break
        if seen == batches:  # an epoch of no batch: the next would find none either
            raise ValueError("no training batch in the features (no answer has a token to "
                             "learn from)")
        epoch += 1


def save_checkpoint(trainer: DrafterTrainer, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(trainer.state(), tmp)
    os.replace(tmp, path)


def job_summary(job: TrainDrafterJob) -> dict[str, Any]:
    fields = asdict(job)
    for key in ("prompt_ids", "prompts", "eval_prompts"):
        fields[key] = len(fields[key])
    fields["out_dir"] = Path(job.out_dir).name
    return fields

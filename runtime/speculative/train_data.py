"""Training data for a drafter: the target's own answers, then its features over them.

Two stages, each resumable, both under DATA_DIR:
1. answers.jsonl — one line per answer: {"id", "prompt_ids", "answer_ids"}, the target's greedy
   answer to each training prompt (id = the prompt's id), generated with our Engine (chat template
   applied, as the generate job does), plus `samples` sampled answers per prompt (ids
   "<prompt id>#s1", "#s2", ...; seeded from the id, so a rerun draws the same text). Sampled
   answers are other texts the target writes, in its own style: more distinct contexts for the
   drafter from the same prompts (the feature loss still teaches the target's own next state).
   Lines are appended as requests finish; a rerun skips ids already present.
2. features-NNNNN.safetensors — the teacher-forced pass of the target over prompt+answer, in shards
   of `shard_size` sequences, packed: input_ids [T], features [T, F] (fp16), seq_starts [S+1]
   (cu_seqlens), loss_start [S] (offset of the first answer token inside each sequence).
   A shard is written to a temp name and renamed, so a present shard is complete.

source.json records what made the data: the target (its name and a digest of its config and
weights) and the features' layers, checked by every later run (answers and features of another
target, or features of other layers, do not fit), and each run that added answers, with its options.

Features: EAGLE-1 uses the final hidden state (after the final norm); EAGLE-3 the concat of the
residual streams entering the three aux layers. They come from the Hugging Face model
(hidden_states[i] = the stream entering layer i, hidden_states[-1] = after the final norm).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from runtime.config import EngineConfig, SamplingParams
from runtime.request import GenerationRequest

ANSWERS = "answers.jsonl"
SOURCE = "source.json"


class PackedShard(NamedTuple):
    input_ids: torch.Tensor  # [T] int64, sequences packed back to back
    features: torch.Tensor  # [T, F] fp16
    seq_starts: torch.Tensor  # [S + 1] int64: sequence s is rows seq_starts[s]:seq_starts[s+1]
    loss_start: torch.Tensor  # [S] int64, first answer token's offset inside sequence s


# a training prompt: a user's message, or a chat (the messages before the target's turn)
Prompt = str | tuple[dict[str, Any], ...]


def render_prompts(prompts: Sequence[Prompt], tokenizer: Any) -> list[list[int] | str]:
    """Chat-templated token ids, exactly as the generate job's tokenize stage makes them (a
    string is one user message; raw text where the tokenizer has no chat template); where the
    template refuses a chat (roles that do not alternate, say), why, as `generate` says it."""
    if not getattr(tokenizer, "chat_template", None):
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError("--messages-column: the target's tokenizer has no chat template to "
                             "render chats with")
        return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]
    texts: list[str] = []
    rendered: list[int | str] = []  # an index into texts, or the template's error
    for p in prompts:
        try:
            texts.append(tokenizer.apply_chat_template(
                [{"role": "user", "content": p}] if isinstance(p, str) else list(p),
                tokenize=False, add_generation_prompt=True))
            rendered.append(len(texts) - 1)
        except Exception as exc:  # the template is the model's code: any failure is the chat's
            rendered.append(f"chat template failed: {' '.join(str(exc).split())[:200]}")
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [list(ids[r]) if isinstance(r, int) else r for r in rendered]


def answer_plan(ids: Sequence[str], samples: int = 0,
                first_sample: int = 1) -> list[tuple[str, int, int | None]]:
    """(answer id, prompt index, seed or None for greedy) of every answer: each prompt's greedy
    answer first, then its sampled ones, numbered from first_sample (a later round of data can
    draw samples an earlier round did not)."""
    plan: list[tuple[str, int, int | None]] = [(i, n, None) for n, i in enumerate(ids)]
    for j in range(first_sample, first_sample + samples):
        plan += [(f"{i}#s{j}", n, zlib.crc32(f"{i}#s{j}".encode())) for n, i in enumerate(ids)]
    return plan


def generate_answers(engine_config: EngineConfig, ids: Sequence[str], prompts: Sequence[Prompt],
                     data_dir: Path, max_answer_tokens: int, progress: Any = None,
                     samples: int = 0, temperature: float = 0.7, first_sample: int = 1) -> Path:
    """Appends every answer of answer_plan(ids, samples, first_sample) not yet in answers.jsonl."""
    from runtime.engine import Engine  # noqa: PLC0415 (heavy; only this stage needs it)

    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / ANSWERS
    done = {row["id"] for row in read_answers(path)}
    todo = [a for a in answer_plan(ids, samples, first_sample) if a[0] not in done]
    if not todo:
        return path
    engine = Engine(engine_config)
    needed = sorted({n for _, n, _ in todo})
    rendered = dict(zip(needed, render_prompts([prompts[n] for n in needed], engine.tokenizer),
                        strict=True))
    failed: list[str] = [f"{i}: {rendered[n]}" for i, n, _ in todo  # refused by the template
                         if isinstance(rendered[n], str)]
    greedy = SamplingParams(max_tokens=max_answer_tokens)
    requests = (GenerationRequest(i, tuple(tokens), greedy if seed is None else
                                  SamplingParams(max_tokens=max_answer_tokens,
                                                 temperature=temperature, seed=seed))
                for i, n, seed in todo if not isinstance(tokens := rendered[n], str))
    _drop_cut_line(path)
    with path.open("a") as f:
        for c in engine.generate(requests):
            if c.finish_reason == "error" or not c.token_ids:
                if c.finish_reason == "error":
                    failed.append(f"{c.request_id}: {c.error}")
                continue
            f.write(json.dumps({"id": c.request_id, "prompt_ids": list(c.prompt_token_ids),
                                "answer_ids": list(c.token_ids)}) + "\n")
            f.flush()
            if progress is not None:
                progress.update(1)
    if failed:
        note = (f"note: {len(failed)} of {len(todo)} answers could not be made and are left out "
                f"(prompt {failed[0]})")
        # on a line of its own, not after the progress bar's
        (progress.write if progress is not None else print)(note, file=sys.stderr)
    return path


def check_answers_fit(data_dir: Path, ids: Sequence[str], prompts: Sequence[Prompt],
                      tokenizer: Any) -> None:
    """Answers in answers.jsonl are reused by id: each one under an id of this run (greedy, or
    sampled: id#sN) must answer this run's prompt of that id, token for token. Another prompts
    file, column or chat template under the same ids would otherwise train the drafter on
    answers to other prompts, without a word: refused, naming the first such id."""
    path = data_dir / ANSWERS
    by_id = {i: n for n, i in enumerate(ids)}
    rows: list[tuple[str, int, list[int]]] = []
    for row in read_answers(path):
        base, mark, number = row["id"].rpartition("#s")
        n = by_id.get(row["id"], by_id.get(base) if mark and number.isdigit() else None)
        if n is not None:
            rows.append((row["id"], n, row["prompt_ids"]))
    if not rows:
        return
    needed = sorted({n for _, n, _ in rows})
    rendered = dict(zip(needed, render_prompts([prompts[n] for n in needed], tokenizer),
                        strict=True))
    stale = [answer_id for answer_id, n, prompt_ids in rows if rendered[n] != prompt_ids]
    if stale:
        raise ValueError(
            f"{path} holds {len(stale)} answer(s) to other prompts under this run's ids (first: "
            f"{stale[0]!r}): the prompts, their column or the chat template changed since they "
            f"were made; choose another --out, or remove {data_dir}")


def _drop_cut_line(path: Path) -> None:
    """Cut off a last line that a crash left without its newline (read_answers skips it), so
    that the next answer starts a line of its own instead of continuing it."""
    if not path.is_file():
        return
    with path.open("rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_answers(path: Path) -> list[dict[str, Any]]:
    """The complete lines of answers.jsonl (a line cut by a crash is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"features-{index:05d}.safetensors"


def write_shard(path: Path, shard: PackedShard) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in shard._asdict().items()}, str(tmp))
    os.replace(tmp, path)


def read_shard(path: Path) -> PackedShard:
    t = load_file(str(path))
    return PackedShard(t["input_ids"], t["features"], t["seq_starts"], t["loss_start"])


def shard_rows(path: Path) -> int:
    """Sequences in a shard, read without loading its features."""
    with safe_open(str(path), "pt") as f:
        return f.get_slice("loss_start").get_shape()[0]


def feature_layers(style: str, aux_layer_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Indices into HF hidden_states: (-1,) for EAGLE-1, the aux layer ids for EAGLE-3."""
    return (-1,) if style == "eagle1" else aux_layer_ids


@torch.inference_mode()
def compute_features(model: Any, rows: Sequence[dict[str, Any]],
                     layers: tuple[int, ...], batch_tokens: int = 2048) -> PackedShard:
    """Teacher-forced pass of an HF causal LM over prompt+answer for each row, packed."""
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in rows]
    feats: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for batch in _length_batches(order, seqs, batch_tokens):
        width = max(len(seqs[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros(len(batch), width, dtype=torch.int64)
        for b, i in enumerate(batch):  # right padding: causal attention keeps real tokens exact
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
            mask[b, :len(seqs[i])] = 1
        # the backbone only: the LM head's logits are not needed
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        h = torch.cat([out.hidden_states[j] for j in layers], dim=-1)
        for b, i in enumerate(batch):
            feats[i] = h[b, :len(seqs[i])].to(torch.float16)
    lengths = torch.tensor([len(s) for s in seqs])
    return PackedShard(
        input_ids=torch.tensor([t for s in seqs for t in s], dtype=torch.int64),
        features=torch.cat(feats),
        seq_starts=torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))),
        loss_start=torch.tensor([len(r["prompt_ids"]) for r in rows], dtype=torch.int64))


def _length_batches(order: list[int], seqs: list[list[int]],
                    batch_tokens: int) -> Iterator[list[int]]:
    batch: list[int] = []
    for i in order:  # ascending length: a batch's padded size is len(batch) * its last length
        if batch and (len(batch) + 1) * len(seqs[i]) > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def build_feature_shards(model_dir: Path, data_dir: Path, layers: tuple[int, ...],
                         shard_size: int = 64, dtype: torch.dtype = torch.float32,
                         include_partial: bool = True, progress: Any = None) -> list[Path]:
    """Writes every missing features shard for answers.jsonl; returns all shard paths.
    include_partial=False skips a last chunk of fewer than shard_size rows (answers still
    being generated); a shard is never rewritten, so build the partial one only at the end."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    rows = read_answers(data_dir / ANSWERS)
    chunks = [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)]
    if chunks and not include_partial and len(chunks[-1]) < shard_size:
        chunks.pop()
    paths = [shard_path(data_dir, i) for i in range(len(chunks))]
    # a shard written for a shorter last chunk (answers added since) is rebuilt
    missing = [i for i, p in enumerate(paths)
               if not p.is_file() or shard_rows(p) != len(chunks[i])]
    if progress is not None:  # shards kept from an earlier run count as done
        progress.update(sum(len(c) for c in chunks) - sum(len(chunks[i]) for i in missing))
    if missing:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.eval()
        for i in missing:
            write_shard(paths[i], compute_features(model, chunks[i], layers))
            if progress is not None:
                progress.update(len(chunks[i]))
    return paths


def read_source(data_dir: Path) -> dict[str, Any] | None:
    path = data_dir / SOURCE
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        raise ValueError(f"{path}: cannot read it as JSON; remove {data_dir} to make the data "
                         "again") from None


def check_source(data_dir: Path, model: str, digest: str, layers: tuple[int, ...]) -> None:
    """Refuse data that another target made, or features of other layers, before any work."""
    source = read_source(data_dir)
    if source is None:  # no data yet, or data of a version that did not record its source
        return
    made_by = source.get("target", {})
    if made_by.get("digest") != digest:
        raise ValueError(f"{data_dir} holds answers and features of another target "
                         f"({made_by.get('model')!r}, other config or weights) than --model "
                         f"{model!r}; they do not fit it: choose another --out, or remove "
                         f"{data_dir}")
    if tuple(source.get("feature_layers", layers)) != layers and _has_features(data_dir):
        raise ValueError(f"{data_dir} holds features of the target's hidden states "
                         f"{tuple(source['feature_layers'])}, but this drafter needs "
                         f"{layers} (another --style); choose another --out, or remove the "
                         f"features-*.safetensors files in {data_dir}")


def record_source(data_dir: Path, model: str, digest: str, layers: tuple[int, ...],
                  answers_run: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Write source.json (with `answers_run` appended to its runs, if given); return the runs
    recorded before this one."""
    source = read_source(data_dir) or {}
    earlier = list(source.get("runs", []))
    data_dir.mkdir(parents=True, exist_ok=True)
    updated = {"target": {"model": model, "digest": digest}, "feature_layers": list(layers),
               "runs": earlier + ([answers_run] if answers_run else [])}
    tmp = data_dir / f".{SOURCE}.tmp"
    tmp.write_text(json.dumps(updated, indent=2) + "\n")
    os.replace(tmp, data_dir / SOURCE)
    return earlier


def _has_features(data_dir: Path) -> bool:
    return any(data_dir.glob("features-*.safetensors"))

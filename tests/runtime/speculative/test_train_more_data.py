"""Growing a drafter's training data and fine-tuning from a trained drafter: sampled answers are
seeded per answer id, a resumed job with more answers rebuilds the shard that was written for a
shorter chunk, and --init-drafter starts from exactly the given drafter's weights."""

from __future__ import annotations

import dataclasses
import shutil
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from jobs.cli import main
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.loader import load_model_config
from runtime.request import GenerationRequest
from runtime.speculative.train_data import (
    answer_plan,
    build_feature_shards,
    read_answers,
    read_shard,
    render_prompts,
    shard_rows,
)
from runtime.speculative.train_init import (
    build_drafter,
    frequent_tokens,
    init_from_drafter,
    load_target,
)
from runtime.speculative.train_job import TrainDrafterJob, resumed_vocab, run_train_drafter
from runtime.speculative.training import TrainConfig
from tests.drafter_fixtures import make_random_drafter

PROMPTS = ("Hello there", "What is two plus two?", "Name a colour.")
IDS = ("a", "b", "c")


def _job(model_dir: Path, out: Path, **overrides: object) -> TrainDrafterJob:
    job = TrainDrafterJob(model=str(model_dir), prompt_ids=IDS, prompts=PROMPTS, out_dir=out,
                          train=TrainConfig(max_steps=2, lr=3e-3, warmup_steps=1,
                                            batch_tokens=128),
                          max_answer_tokens=10, data_dtype="float32", save_dtype="float32")
    return dataclasses.replace(job, **overrides)  # type: ignore[arg-type]


def test_answer_plan_lists_greedy_answers_then_seeded_samples() -> None:
    assert answer_plan(["a", "b"], 2) == [
        ("a", 0, None), ("b", 1, None),
        ("a#s1", 0, zlib.crc32(b"a#s1")), ("b#s1", 1, zlib.crc32(b"b#s1")),
        ("a#s2", 0, zlib.crc32(b"a#s2")), ("b#s2", 1, zlib.crc32(b"b#s2"))]
    assert answer_plan(["a"], 0) == [("a", 0, None)]


def test_answer_plan_from_a_later_sample_draws_new_seeds() -> None:
    assert answer_plan(["a", "b"], 2, first_sample=4) == [
        ("a", 0, None), ("b", 1, None),
        ("a#s4", 0, zlib.crc32(b"a#s4")), ("b#s4", 1, zlib.crc32(b"b#s4")),
        ("a#s5", 0, zlib.crc32(b"a#s5")), ("b#s5", 1, zlib.crc32(b"b#s5"))]


def test_more_answers_on_resume_rebuild_the_short_shard(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out))
    data = out / "data"
    assert shard_rows(data / "features-00000.safetensors") == 3
    run_train_drafter(_job(tiny_model_dir, out, resume=True, answer_samples=1,
                           answer_temperature=1.0,
                           train=TrainConfig(max_steps=3, batch_tokens=128)))
    rows = read_answers(data / "answers.jsonl")
    assert [r["id"] for r in rows] == ["a", "b", "c", "a#s1", "b#s1", "c#s1"]
    shard = read_shard(data / "features-00000.safetensors")
    assert shard_rows(data / "features-00000.safetensors") == 6
    assert shard.input_ids.tolist() == [t for r in rows for t in r["prompt_ids"] + r["answer_ids"]]
    card = (out / "README.md").read_text()
    assert "greedy answer to each and 1 sampled at temperature 1.0" in card

    # each sampled answer is the engine's draw for the seed of its id, whatever its batch
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_model_len=128))
    ids = render_prompts(PROMPTS, engine.tokenizer)
    greedy = {r["id"]: r["answer_ids"] for r in rows[:3]}
    for n, key in enumerate(IDS):
        params = SamplingParams(max_tokens=10, temperature=1.0,
                                seed=zlib.crc32(f"{key}#s1".encode()))
        [alone] = engine.generate([GenerationRequest(key, tuple(ids[n]), params)])
        assert list(alone.token_ids) == rows[3 + n]["answer_ids"]
        assert rows[3 + n]["prompt_ids"] == rows[n]["prompt_ids"]
    assert any(r["answer_ids"] != greedy[r["id"][0]] for r in rows[3:])


class _Bar:
    """Records a progress bar's updates."""

    def __init__(self) -> None:
        self.updates: list[int] = []

    def update(self, n: int) -> None:
        self.updates.append(n)


def test_feature_progress_counts_kept_shards_as_done(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    """A later round adds answers to a copy of the data directory: its progress bar (total =
    all answers) starts at the rows of the shards kept, so its estimate is for the new ones."""
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out))
    data = out / "data"
    first = build_feature_shards(tiny_model_dir, data, (-1,), shard_size=2, progress=_Bar())
    assert [shard_rows(p) for p in first] == [2, 1]
    bar = _Bar()
    build_feature_shards(tiny_model_dir, data, (-1,), shard_size=2, progress=bar)
    assert bar.updates == [3]  # nothing computed
    first[1].unlink()
    bar = _Bar()
    build_feature_shards(tiny_model_dir, data, (-1,), shard_size=2, progress=bar)
    assert bar.updates == [2, 1]  # shard 0 kept, shard 1 computed
    assert shard_rows(first[1]) == 1


def test_init_drafter_starts_from_its_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    run_train_drafter(_job(tiny_model_dir, first, draft_head_size=20))
    saved = load_file(str(first / "model.safetensors"))
    target = load_target(tiny_model_dir, load_model_config(tiny_model_dir))
    job = _job(tiny_model_dir, tmp_path / "second", init_drafter=first)
    drafter = build_drafter(target, job, torch.arange(40, 120))
    state = drafter.state_dict()
    assert {k for k in saved if k not in ("lm_head.weight", "d2t")} == set(state)
    for name, tensor in state.items():
        assert torch.equal(tensor, saved[name]), name

    with pytest.raises(ValueError, match="eagle1 with 2 layers; this job trains eagle1 with 1"):
        init_from_drafter(build_drafter(target, _job(tiny_model_dir, tmp_path / "x",
                                                     num_layers=1), torch.arange(40, 120)),
                          first, target.config)

    run_train_drafter(job)  # fine-tunes from there and saves as usual
    assert (tmp_path / "second" / "model.safetensors").is_file()
    assert "the weights of the drafter `first`" in (tmp_path / "second" / "README.md").read_text()


def test_cli_refuses_a_bad_init_drafter_before_making_data(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    first = tmp_path / "first"
    run_train_drafter(_job(tiny_model_dir, first))  # 2 layers
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": list(PROMPTS)}), prompts)
    base = ["train-drafter", "--model", str(tiny_model_dir), "--prompts", str(prompts),
            "--max-steps", "1", "--out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    # a drafter may run with other heads than its target's, but this job trains the target's
    other = make_random_drafter(tiny_model_dir, tmp_path / "other", num_layers=2,
                                num_attention_heads=8, num_key_value_heads=1, head_dim=16)
    cases = ((empty, "2", "no config.json"),
             (first, "1", "eagle1 with 2 layers; this job trains eagle1 with 1"),
             (other, "2", "has num_attention_heads 8 (the target's: 4), num_key_value_heads 1 "
                          "(the target's: 2); this job trains drafters whose layers have the "
                          "target's shape"))
    for init, layers, words in cases:
        out = tmp_path / f"out-{layers}"
        result = CliRunner().invoke(main, [*base, str(out), "--layers", layers,
                                           "--init-drafter", str(init)])
        assert result.exit_code == 2, result.output
        assert "--init-drafter" in result.output and words in " ".join(result.output.split())
        assert str(init) in result.output.replace("\n", "")
        assert not out.exists()  # nothing was made


def test_cli_first_sample_draws_later_samples(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": list(IDS), "prompt": list(PROMPTS)}), prompts)

    def train(out: Path, samples: int, first: int) -> list[str]:
        """train-drafter with `samples` sampled answers from #first; the answers' ids."""
        result = CliRunner().invoke(main, [
            "train-drafter", "--model", str(tiny_model_dir), "--prompts", str(prompts),
            "--out", str(out), "--max-steps", "1", "--max-answer-tokens", "6",
            "--answer-samples", str(samples), "--first-sample", str(first),
            "--data-dtype", "float32"])
        assert result.exit_code == 0, result.output
        return sorted(r["id"] for r in read_answers(out / "data" / "answers.jsonl"))

    out = tmp_path / "d"
    assert train(out, 2, 3) == sorted([*IDS, *(f"{i}#s{j}" for j in (3, 4) for i in IDS)])
    assert ("its greedy answer to each and 2 sampled at temperature 0.7 (samples #3-#4)"
            in (out / "README.md").read_text())
    # a later round in a fresh directory on a copy of this data: one new sample per prompt, the
    # earlier samples stay in the data (and are trained on), and the card says so
    later = tmp_path / "later"
    shutil.copytree(out / "data", later / "data")
    assert train(later, 1, 5) == sorted(
        [*IDS, *(f"{i}#s{j}" for j in (3, 4, 5) for i in IDS)])
    card = " ".join((later / "README.md").read_text().split())
    assert (f"Data: {4 * len(IDS)} answers" in card and "and 1 sampled at temperature 0.7 "
            f"(sample #5), besides {2 * len(IDS)} answers an earlier run left in the data "
            "directory" in card)


def test_an_eagle3_drafter_keeps_its_draft_vocabulary_on_resume_and_drops_it_to_fine_tune(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found by QA: --resume with more answers trained the head over the checkpoint's draft
    vocabulary against a loss over the new answers' most frequent tokens (loss 2.8 -> 7.8), and
    --init-drafter from an EAGLE-3 drafter of another vocabulary size failed after making the
    data (its head, which build_drafter replaces anyway, did not fit)."""
    out = tmp_path / "d"
    run_train_drafter(_job(tiny_model_dir, out, style="eagle3", draft_vocab_size=12,
                           prompt_ids=IDS[:1], prompts=PROMPTS[:1]))
    first = load_file(str(out / "model.safetensors"))["d2t"]
    run_train_drafter(_job(tiny_model_dir, out, style="eagle3", draft_vocab_size=12,
                           resume=True, train=TrainConfig(max_steps=3, batch_tokens=128)))
    assert len(read_answers(out / "data" / "answers.jsonl")) == 3
    resumed = load_file(str(out / "model.safetensors"))["d2t"]
    assert torch.equal(resumed, first)
    # the loss's tokens are the head's, not the three answers' most frequent ones
    kept = torch.arange(12) + first
    assert not torch.equal(frequent_tokens(read_answers(out / "data" / "answers.jsonl"), 12), kept)
    job = _job(tiny_model_dir, out, style="eagle3", resume=True)
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert torch.equal(resumed_vocab(state, job), kept)
    with pytest.raises(ValueError) as err:
        run_train_drafter(_job(tiny_model_dir, out, style="eagle3", draft_vocab_size=20,
                               resume=True, train=TrainConfig(max_steps=4, batch_tokens=128)))
    assert str(err.value) == (f"--draft-vocab-size 20: {out / 'checkpoint.pt'} was trained over "
                              "a draft vocabulary of 12 tokens, which --resume keeps")
    tuned = tmp_path / "tuned"
    run_train_drafter(_job(tiny_model_dir, tuned, style="eagle3", draft_vocab_size=30,
                           init_drafter=out))
    assert len(load_file(str(tuned / "model.safetensors"))["d2t"]) == 30

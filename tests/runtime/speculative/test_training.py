"""Drafter training on the tiny random target: the training forward equals the paged forward,
a few steps lower the loss, the saved drafter decodes losslessly in the engine, --resume
continues from the step it stopped at."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.attention import build_attention_metadata
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.kv.cache import compute_slot_mapping
from runtime.loader import load_model_config
from runtime.request import GenerationRequest
from runtime.speculative.train_data import read_answers, read_shard
from runtime.speculative.train_forward import step_mask, unrolled_forward
from runtime.speculative.train_init import build_drafter, load_target
from runtime.speculative.train_job import TrainDrafterJob, run_train_drafter
from runtime.speculative.training import DrafterTrainer, TrainConfig, collate

PROMPTS = ("Hello there", "What is two plus two?", "Name a colour.", "Tell me a story",
           "Count to five", "Why is the sky blue?")
BLOCK = 4


def _job(model_dir: Path, out: Path, **overrides: object) -> TrainDrafterJob:
    train = TrainConfig(max_steps=12, lr=3e-3, warmup_steps=2, batch_tokens=128, seed=0)
    job = TrainDrafterJob(model=str(model_dir), prompt_ids=tuple(str(i) for i in range(6)),
                          prompts=PROMPTS, out_dir=out, train=train, max_answer_tokens=12,
                          data_dtype="float32", save_dtype="float32")
    return dataclasses.replace(job, **overrides)  # type: ignore[arg-type]


def _paged(drafter, ids: list[int], positions: list[int], feats: torch.Tensor,
           caches: dict[str, torch.Tensor], seq_len: int) -> torch.Tensor:
    table = [1, 2, 3, 4]
    slots = compute_slot_mapping(table, positions, BLOCK)
    md = build_attention_metadata([len(ids)], [seq_len], [table], slots, torch.device("cpu"))
    return drafter(torch.tensor(ids), torch.tensor(positions), feats, caches,
                   {name: md for name in drafter.layer_names})


def test_step_mask() -> None:
    assert step_mask(1, 3, torch.device("cpu")).int().tolist() == [
        [1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]


# a drafter with another head count than its target's (4 heads of 16, 2 KV heads): 1 KV head
OTHER_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}


@pytest.mark.parametrize("heads", [{}, OTHER_HEADS], ids=["target's heads", "other KV heads"])
@pytest.mark.parametrize("style", ["eagle1", "eagle3"])
def test_training_forward_equals_paged_forward(tiny_model_dir: Path, tmp_path: Path,
                                               style: str, heads: dict[str, int]) -> None:
    target = load_target(tiny_model_dir, load_model_config(tiny_model_dir))
    job = _job(tiny_model_dir, tmp_path, style=style, num_layers=2, init_from_target=False)
    drafter = build_drafter(target, job, torch.arange(40, 120), **heads)
    assert (drafter.layers[0].self_attn.head_dim, drafter.layers[0].self_attn.num_kv_heads) == (
        (heads["head_dim"], heads["num_key_value_heads"]) if heads else (16, 2))
    for p in drafter.parameters():  # random weights everywhere, norms included
        torch.nn.init.normal_(p, 0.0, 0.2)
    torch.manual_seed(1)
    ids = torch.randint(4, 256, (10,))
    feats = torch.randn(10, (3 if style == "eagle3" else 1) * 64)
    with torch.no_grad():
        hidden = unrolled_forward(drafter, ids[None], feats[None], num_steps=3)
        head = drafter.layers[0].self_attn
        caches = {n: torch.zeros(2, 5, BLOCK, head.num_kv_heads, head.head_dim)
                  for n in drafter.layer_names}
        # step 1 over the whole sequence: token at p + 1 with the feature at p
        step0 = _paged(drafter, ids[1:].tolist(), list(range(9)), feats[:9], caches, 9)
        torch.testing.assert_close(hidden[0][0, :9], step0, rtol=1e-4, atol=1e-4)
        # anchor 5: the prefix, then two drafts fed with the drafter's own outputs
        caches = {n: torch.zeros_like(c) for n, c in caches.items()}
        prefix = _paged(drafter, ids[1:7].tolist(), list(range(6)), feats[:6], caches, 6)
        d1 = _paged(drafter, [int(ids[7])], [6], prefix[5:6], caches, 7)
        d2 = _paged(drafter, [int(ids[8])], [7], d1, caches, 8)
    torch.testing.assert_close(hidden[1][0, 5], d1[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[2][0, 5], d2[0], rtol=1e-4, atol=1e-4)


def test_a_few_steps_lower_the_loss(tiny_model_dir: Path, tmp_path: Path) -> None:
    job = _job(tiny_model_dir, tmp_path / "d", train=TrainConfig(max_steps=1))
    run_train_drafter(job)  # makes the data (and one step)
    target = load_target(tiny_model_dir, load_model_config(tiny_model_dir))
    vocab = torch.arange(256)
    drafter = build_drafter(target, job, vocab)
    config = TrainConfig(max_steps=30, lr=3e-3, warmup_steps=2)
    trainer = DrafterTrainer(drafter, config, loss_vocab=vocab)
    batch = collate(read_shard(job.out_dir / "data" / "features-00000.safetensors"), [0, 1, 2])
    with torch.no_grad():
        before = float(trainer.loss(batch)[0])
    for _ in range(30):
        trainer.train_step(batch)
    with torch.no_grad():
        after = float(trainer.loss(batch)[0])
    assert after < 0.8 * before


def _greedy(model_dir: Path, drafter: Path | None) -> list[tuple[int, ...]]:
    engine = Engine(EngineConfig(model=str(model_dir), drafter=str(drafter) if drafter else None,
                                 block_size=BLOCK, max_model_len=128))
    ids = [tuple(engine.tokenizer(p)["input_ids"]) for p in PROMPTS[:4]]
    done = engine.generate(GenerationRequest(str(i), t, SamplingParams(max_tokens=20))
                           for i, t in enumerate(ids))
    return [c.token_ids for c in sorted(done, key=lambda c: int(c.request_id))]


def test_trained_drafter_is_lossless_and_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    run_train_drafter(_job(tiny_model_dir, out, train=TrainConfig(max_steps=4, batch_tokens=128),
                           eval_prompts=PROMPTS[:2], eval_max_tokens=8))
    assert len(read_answers(out / "data" / "answers.jsonl")) == len(PROMPTS)
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 4
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    assert _greedy(tiny_model_dir, out) == _greedy(tiny_model_dir, None)
    with pytest.raises(FileExistsError):
        run_train_drafter(_job(tiny_model_dir, out))
    data_mtime = (out / "data" / "features-00000.safetensors").stat().st_mtime
    run_train_drafter(_job(tiny_model_dir, out, resume=True,
                           train=TrainConfig(max_steps=7, batch_tokens=128)))
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 7
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log] == list(range(1, 8))  # the resumed run's log continues
    assert "7 steps" in (out / "README.md").read_text()
    assert (out / "data" / "features-00000.safetensors").stat().st_mtime == data_mtime


def test_draft_head_size_saves_own_head_that_decodes_losslessly(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    run_train_drafter(_job(tiny_model_dir, out, draft_head_size=7,
                           train=TrainConfig(max_steps=2, batch_tokens=128)))
    tensors = load_file(str(out / "model.safetensors"))
    target = load_target(tiny_model_dir, load_model_config(tiny_model_dir))
    hidden = target.config.hidden_size
    assert tensors["lm_head.weight"].shape == (7, hidden)
    target_ids = torch.arange(7) + tensors["d2t"]
    rows = read_answers(out / "data" / "answers.jsonl")
    counts = Counter(t for r in rows for t in r["answer_ids"])
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:7]
    assert target_ids.tolist() == sorted(t for t, _ in top)
    assert torch.equal(tensors["lm_head.weight"], target.head_weight.detach()[target_ids])
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 7
    assert "7 most frequent answer tokens" in (out / "README.md").read_text()
    assert _greedy(tiny_model_dir, out) == _greedy(tiny_model_dir, None)


def test_an_eagle3_drafter_of_a_small_target_loads_and_is_lossless(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    # the usual aux layers (2, L/2, L-3) do not exist in a 2-layer target
    from runtime.speculative.train_job import train_aux_layer_ids  # noqa: PLC0415

    assert train_aux_layer_ids(2) == (0, 1, 1) and train_aux_layer_ids(32) == (2, 16, 29)
    out = tmp_path / "drafter"
    run_train_drafter(_job(tiny_model_dir, out, style="eagle3", num_layers=2,
                           train=TrainConfig(max_steps=2, batch_tokens=128)))
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    assert (out.stat().st_mode & 0o077) == (0o777 & ~_umask() & 0o077)  # readable as umask says
    assert _greedy(tiny_model_dir, out) == _greedy(tiny_model_dir, None)
    # --resume with other options: refused before the answers are made again
    with pytest.raises(ValueError, match=r"^--resume: .*checkpoint.pt holds a 2-layer eagle3 "
                                         r"drafter, but the options ask for --layers 2 --style "
                                         r"eagle1$"):
        run_train_drafter(_job(tiny_model_dir, out, resume=True))
    with pytest.raises(ValueError, match=r"^--draft-vocab-size 100000 is larger than the "
                                         r"target's vocabulary \(256 tokens\)$"):
        run_train_drafter(_job(tiny_model_dir, tmp_path / "other", draft_vocab_size=100000))


def _umask() -> int:
    import os  # noqa: PLC0415

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_train_drafter_cli_errors_are_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415
    from click.testing import CliRunner  # noqa: PLC0415

    from jobs.cli import main  # noqa: PLC0415
    from jobs.train_drafter import read_prompts  # noqa: PLC0415

    mixed = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"prompt": ["ok", None, " ", "fine"]}), mixed)
    assert read_prompts(mixed) == (("0", "3"), ("ok", "fine"))  # null and blank left out
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text("no")
    base = ["train-drafter", "--model", str(tiny_model_dir), "--max-steps", "1"]
    for path, message in [(empty, f"{empty} has no prompt to train on (rows: 0;"),
                          (not_parquet, f"{not_parquet}: cannot read it as Parquet (")]:
        result = CliRunner().invoke(main, [*base, "--prompts", str(path), "--out",
                                           str(tmp_path / "o")])
        assert result.exit_code == 2 and message in result.output, result.output
    out = tmp_path / "has-checkpoint"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"x")
    result = CliRunner().invoke(main, [*base, "--prompts", str(mixed), "--out", str(out)])
    assert (result.exit_code, result.stderr) == (
        2, f"error: {out} holds a training checkpoint; pass --resume\n")

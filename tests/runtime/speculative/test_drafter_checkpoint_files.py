"""Drafter folders as people actually leave them: a config copied from the target (a Qwen2 one
carries one layer_types entry per target layer), a training run's optimizer.bin beside the
weights, attention biases the config does not mention, damaged files; and the errors that name
what is wrong."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.loader import load_state_dict
from runtime.request import Completion
from runtime.speculative.draft_vocab import DrafterMismatchError
from runtime.speculative.loader import drafter_num_layers, load_drafter_checkpoint
from tests.drafter_fixtures import generate_greedy, make_random_drafter
from tests.fixtures import make_tiny_checkpoint


def generate(model_dir: Path, drafter: Path | None) -> dict[str, Completion]:
    return generate_greedy(model_dir, drafter, max_tokens=16)


def tokens(out: dict[str, Completion]) -> dict[str, list[int]]:
    return {k: list(c.token_ids) for k, c in out.items()}


def as_bin(drafter: Path) -> Path:
    """The drafter's weights moved from model.safetensors to pytorch_model.bin."""
    tensors = load_file(str(drafter / "model.safetensors"))
    (drafter / "model.safetensors").unlink()
    torch.save(tensors, drafter / "pytorch_model.bin")
    return drafter / "pytorch_model.bin"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), arch="qwen2", num_layers=3)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_a_config_copied_from_a_qwen2_target_loads_and_is_lossless(
        qwen2_dir: Path, tmp_path: Path, model_type: str) -> None:
    # q/k/v biases as a Qwen2 drafter has them, whatever model_type its config then says
    drafter = make_random_drafter(qwen2_dir, tmp_path / "d", num_layers=2, model_type="qwen2")
    target_config = json.loads((qwen2_dir / "config.json").read_text())
    assert len(target_config["layer_types"]) == 3  # what transformers writes for Qwen2
    own = json.loads((drafter / "config.json").read_text())
    config = target_config | {"num_hidden_layers": 2, "architectures": own["architectures"],
                              "model_type": model_type}
    (drafter / "config.json").write_text(json.dumps(config))

    ckpt = load_drafter_checkpoint(drafter, AutoConfig.from_pretrained(qwen2_dir))
    assert ckpt.config.num_hidden_layers == 2 and ckpt.config.model_type == "qwen2"
    assert "layers.1.self_attn.q_proj.bias" in ckpt.state_dict
    out = generate(qwen2_dir, drafter)
    assert tokens(out) == tokens(generate(qwen2_dir, None))
    assert sum(c.num_drafted for c in out.values()) > 0


def test_attention_biases_follow_the_weights_not_the_config(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # a drafter with q/k/v and o_proj biases whose config says model_type qwen2 (which would
    # mean q/k/v biases only) and no attention_bias
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=1,
                                  attention_bias=True)
    config = json.loads((drafter / "config.json").read_text())
    config.update(model_type="qwen2", attention_bias=False)
    (drafter / "config.json").write_text(json.dumps(config))
    ckpt = load_drafter_checkpoint(drafter, AutoConfig.from_pretrained(tiny_model_dir))
    assert (ckpt.config.model_type, ckpt.config.attention_bias) == ("llama", True)
    assert tokens(generate(tiny_model_dir, drafter)) == tokens(generate(tiny_model_dir, None))


def test_a_training_runs_other_bin_files_are_not_read(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=2)
    target = AutoConfig.from_pretrained(tiny_model_dir)
    expected = load_drafter_checkpoint(drafter, target).state_dict
    as_bin(drafter)
    weights = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(weights.parameters())
    torch.save(optimizer.state_dict(), drafter / "optimizer.bin")
    torch.save({"last_epoch": 3, "_step_count": 4}, drafter / "scheduler.bin")
    (drafter / "training_args.bin").write_bytes(pickle.dumps({"lr": object}))
    state = load_drafter_checkpoint(drafter, target).state_dict
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)

    (drafter / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors or pytorch_model\*.bin "
                       r"weights \(not weights: optimizer.bin, scheduler.bin, training_args.bin\)"):
        load_drafter_checkpoint(drafter, target)


def test_a_damaged_bin_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=1)
    weights = as_bin(drafter)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    target = AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(DrafterMismatchError,
                       match=f"drafter {weights}: cannot read it as PyTorch weights"):
        load_drafter_checkpoint(drafter, target)
    torch.save([torch.zeros(2)], weights)
    with pytest.raises(DrafterMismatchError,
                       match=f"drafter {weights}: not a checkpoint of named tensors "
                             r"\(holds a list\)"):
        load_drafter_checkpoint(drafter, target)


def test_a_damaged_target_bin_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    weights = model / "pytorch_model.bin"
    weights.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ValueError, match=f"{weights}: cannot read it as PyTorch weights"):
        load_state_dict(model, torch.float32)


def _edit_config(drafter: Path, **changes: object) -> None:
    config = json.loads((drafter / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (drafter / "config.json").write_text(json.dumps(config))


def test_configs_that_do_not_match_their_weights_are_named(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    target = AutoConfig.from_pretrained(tiny_model_dir)  # hidden 64, 4 heads of 16, 2 layers
    eagle1 = make_random_drafter(tiny_model_dir, tmp_path / "e1", num_layers=1)
    _edit_config(eagle1, hidden_size=None)
    with pytest.raises(DrafterMismatchError, match=f"drafter {eagle1 / 'config.json'}: no "
                                                   "hidden_size"):
        load_drafter_checkpoint(eagle1, target)

    _edit_config(eagle1, hidden_size=64, num_attention_heads=8, head_dim=16)
    with pytest.raises(ValueError, match=re.escape(
            f"drafter {eagle1}: weights do not have the shapes its config.json gives "
            "(hidden_size 64, num_attention_heads 8, num_key_value_heads 2, head_dim 16, "
            "intermediate_size 128): layers.0.self_attn.q_proj.weight (64, 64) "
            "(expected (128, 64))")):
        Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 20,
                            drafter=str(eagle1)))

    eagle3 = make_random_drafter(tiny_model_dir, tmp_path / "e3", num_layers=1, style="eagle3",
                                 aux_layer_ids=(0, 1, 5))
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {eagle3}: EAGLE-3 aux layer ids (0, 1, 5) "
            "(eagle_aux_hidden_state_layer_ids) do not fit a target with 2 layers")):
        load_drafter_checkpoint(eagle3, target)
    _edit_config(eagle3, eagle_aux_hidden_state_layer_ids=None)
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {eagle3}: EAGLE-3 aux layer ids (2, 1, -1) (the default (2, L/2, L-3) "
            "for a config without eagle_aux_hidden_state_layer_ids)")):
        load_drafter_checkpoint(eagle3, target)

    tensors = load_file(str(eagle3 / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(32, 3 * 64)  # a drafter narrower than its target
    save_file(tensors, str(eagle3 / "model.safetensors"))
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {eagle3}: fc.weight maps 3 target features of 64 to 32; drafters "
            "narrower or wider than their target")):
        load_drafter_checkpoint(eagle3, target)



def test_what_the_drafter_folder_holds_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found by a reviewer of the layouts: each was refused or accepted for another reason."""
    target = AutoConfig.from_pretrained(tiny_model_dir)  # vocab 256, 2 layers
    a_file = tiny_model_dir / "config.json"
    for path, message in ((tmp_path / "nowhere", f"drafter {tmp_path / 'nowhere'}: no such "
                                                 "directory"),
                          (a_file, f"drafter {a_file} is a file; expected an EAGLE")):
        with pytest.raises(FileNotFoundError, match=re.escape(message)):
            load_drafter_checkpoint(path, target)

    # made for another vocabulary: its config says so, or the embedding it carries
    other = make_random_drafter(tiny_model_dir, tmp_path / "vocab", num_layers=1,
                                style="eagle3", draft_vocab_size=50, aux_layer_ids=(0, 1, 1))
    _edit_config(other, vocab_size=32000)
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {other / 'config.json'}: vocab_size is 32000 but the target's is 256: a "
            "drafter made for another model")):
        load_drafter_checkpoint(other, target)
    _edit_config(other, vocab_size=256, draft_vocab_size=60)
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {other / 'config.json'}: draft_vocab_size is 60 but lm_head.weight has 50 "
            "rows")):
        load_drafter_checkpoint(other, target)
    eagle1 = make_random_drafter(tiny_model_dir, tmp_path / "e1", num_layers=1)
    tensors = load_file(str(eagle1 / "model.safetensors"))
    save_file(tensors | {"embed_tokens.weight": torch.zeros(300, 64)},
              str(eagle1 / "model.safetensors"))
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {eagle1}: embed_tokens.weight has 300 rows but the target's vocabulary has "
            "256")):
        load_drafter_checkpoint(eagle1, target)


def test_layouts_that_load_and_stay_lossless(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A rotary inv_freq buffer (older transformers saved it), a config without
    num_hidden_layers (its weights say 2, where LlamaConfig's default is 32), and an EAGLE-3
    checkpoint without lm_head.weight (it drafts from the target's head): each was refused."""
    target = AutoConfig.from_pretrained(tiny_model_dir)
    plain = make_random_drafter(tiny_model_dir, tmp_path / "plain", num_layers=2)
    reference = tokens(generate(tiny_model_dir, None))
    drafted = generate(tiny_model_dir, plain)

    buffer = make_random_drafter(tiny_model_dir, tmp_path / "buffer", num_layers=2)
    tensors = load_file(str(buffer / "model.safetensors"))
    save_file(tensors | {"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
              str(buffer / "model.safetensors"))
    _edit_config(buffer, num_hidden_layers=None)
    assert load_drafter_checkpoint(buffer, target).config.num_hidden_layers == 2
    assert {k: (list(c.token_ids), c.num_drafted) for k, c in generate(tiny_model_dir,
                                                                        buffer).items()} == \
        {k: (list(c.token_ids), c.num_drafted) for k, c in drafted.items()}

    headless = make_random_drafter(tiny_model_dir, tmp_path / "e3", num_layers=1,
                                   style="eagle3", draft_vocab_size=50, aux_layer_ids=(0, 1, 1))
    tensors = load_file(str(headless / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(headless / "model.safetensors"))
    ckpt = load_drafter_checkpoint(headless, target)
    assert ckpt.style == "eagle3" and not {"lm_head.weight", "d2t", "norm.weight"} & set(
        ckpt.state_dict)
    out = generate(tiny_model_dir, headless)
    assert tokens(out) == reference
    assert sum(c.num_drafted for c in out.values()) > 0


def test_damaged_indexes_shapes_and_dtypes_are_named(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    """Found by a reviewer with unseen checkpoints: a malformed shard index gave a KeyError
    traceback, a 1-D fc.weight 'not enough values to unpack', and tensors of the wrong dtype
    (a float or bool d2t, an int weight) were cast without a word."""
    target = AutoConfig.from_pretrained(tiny_model_dir)
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", num_layers=1)
    index = drafter / "model.safetensors.index.json"
    for text, reason in (('{"metadata": {}}', "no weight_map"),
                         ("[]", "cannot read it as a shard index (not a JSON object)"),
                         ("{oops", "cannot read it as a shard index (Expecting property name")):
        index.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{index}: {reason}")):
            load_drafter_checkpoint(drafter, target)
    index.unlink()

    folder = make_random_drafter(tiny_model_dir, tmp_path / "folder", num_layers=1)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'model.safetensors'}: not a "
                                                   "file")):
        load_drafter_checkpoint(folder, target)

    weights = load_file(str(drafter / "model.safetensors"))
    for key, value, message in (
            ("fc.weight", torch.zeros(64), "fc.weight has shape (64,); expected [H, 2H]"),
            ("fc.weight", torch.zeros(64, 128, dtype=torch.int32),
             "fc.weight has dtype int32; expected floating point"),
            ("lm_head.weight", torch.zeros(4096), "lm_head.weight has shape (4096,); expected "
                                                  "[draft vocabulary, hidden size]"),
            ("d2t", torch.zeros(256), "d2t has dtype float32; expected integers"),
            ("d2t", torch.zeros(256, dtype=torch.bool), "d2t has dtype bool; expected integers")):
        save_file(weights | {key: value}, str(drafter / "model.safetensors"))
        with pytest.raises(DrafterMismatchError, match=re.escape(f"drafter {drafter}: {message}")):
            load_drafter_checkpoint(drafter, target)


def test_configs_the_public_layouts_leave_out_or_spell_otherwise(tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    """A config without vocab_size was refused with LlamaConfig's 32000; aux layer ids as a
    string were shown split into characters; ids listed out of order fed the target's streams
    in that order, where vLLM and SGLang take them in layer order; and bench counted a .bin
    drafter's layers from its config (1 without num_hidden_layers, a TypeError with null)."""
    target = AutoConfig.from_pretrained(tiny_model_dir)  # 2 layers
    eagle1 = make_random_drafter(tiny_model_dir, tmp_path / "e1", num_layers=2)
    _edit_config(eagle1, vocab_size=None)
    assert load_drafter_checkpoint(eagle1, target).config.vocab_size == 256
    as_bin(eagle1)
    for layers in (None, 1):
        _edit_config(eagle1, num_hidden_layers=layers)
        assert drafter_num_layers(eagle1) == 2
    (eagle1 / "config.json").write_text(json.dumps(
        json.loads((eagle1 / "config.json").read_text()) | {"num_hidden_layers": None}))
    assert drafter_num_layers(eagle1) == 2

    eagle3 = make_random_drafter(tiny_model_dir, tmp_path / "e3", num_layers=1, style="eagle3",
                                 draft_vocab_size=50, aux_layer_ids=(1, 0, 1))
    assert load_drafter_checkpoint(eagle3, target).aux_layer_ids == (0, 1, 1)
    _edit_config(eagle3, eagle_aux_hidden_state_layer_ids="0,1,1")
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {eagle3 / 'config.json'}: eagle_aux_hidden_state_layer_ids is '0,1,1'; "
            "expected a list of three target layer indices")):
        load_drafter_checkpoint(eagle3, target)

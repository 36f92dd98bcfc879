"""load_state_dict: a checkpoint's tensors as transformers loads them (llama, qwen2, mistral,
tied), cast, sharded or pickled; safetensors files read into tensors, refused by name when cut
short or damaged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.loader import load_state_dict
from tests.fixtures import make_tiny_checkpoint
from tests.runtime.conftest import assert_same_tensors


def hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", False),
                                            ("mistral", False), ("llama", True)])
def test_load_state_dict_equals_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, arch=arch, tie_word_embeddings=tied)
    want = hf_state_dict(model_dir)
    if tied:
        assert torch.equal(want.pop("lm_head.weight"), want["model.embed_tokens.weight"])
    got = load_state_dict(model_dir, torch.float32)
    assert_same_tensors(got, want)
    assert got["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert ("model.layers.0.self_attn.q_proj.bias" in got) == (arch == "qwen2")


def test_load_state_dict_casts_floating_tensors(tiny_model_dir: Path) -> None:
    full = load_state_dict(tiny_model_dir, torch.float32)
    half = load_state_dict(tiny_model_dir, torch.bfloat16, device=torch.device("cpu"))
    assert_same_tensors(half, {k: t.to(torch.bfloat16) for k, t in full.items()})


def test_sharded_and_bin_checkpoints_load_identically(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    want = load_state_dict(tiny_model_dir, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_same_tensors(load_state_dict(sharded, torch.float32), want)
    (sharded / "model.safetensors.index.json").unlink()  # the glob finds the shards too
    assert_same_tensors(load_state_dict(sharded, torch.float32), want)

    pickled = tmp_path / "bin"
    pickled.mkdir()
    shutil.copy(tiny_model_dir / "config.json", pickled)
    torch.save(want, pickled / "pytorch_model.bin")
    assert_same_tensors(load_state_dict(pickled, torch.float32), want)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_state_dict(tmp_path, torch.float32)


def test_safetensors_read_into_tensors_match_safetensors_own_reader(tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Every dtype the format's table has, read with file reads, equals safe_open's tensors;
    a file with an unreadable header or cut short is refused naming the file."""
    from safetensors.torch import load_file, save_file

    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(4).bfloat16(),
        "f16": torch.randn(2, 2).half(), "i64": torch.arange(7),
        "u8": torch.arange(3, dtype=torch.uint8),
        "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    model = tmp_path / "m"
    model.mkdir()
    save_file(tensors, model / "model.safetensors")
    got = dict(load_state_dict(model, torch.float32))
    want = {k: t.float() if t.is_floating_point() else t
            for k, t in load_file(model / "model.safetensors").items()}
    assert_same_tensors(got, want)
    assert got["i64"].dtype == torch.int64 and got["flag"].dtype == torch.bool

    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="model.safetensors: .* is cut short"):
        load_state_dict(model, torch.float32)
    (model / "model.safetensors").write_bytes(data[:8] + b"garbage!" + data[16:])
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file"):
        load_state_dict(model, torch.float32)
    # a header entry without its dtype gave a KeyError (found by QA)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    del header["f32"]["dtype"]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    (model / "model.safetensors").write_bytes(data[:8] + text + data[8 + size:])
    with pytest.raises(ValueError) as err:
        load_state_dict(model, torch.float32)
    assert str(err.value) == (f"{model / 'model.safetensors'}: not a safetensors file (the "
                              "header's entry for 'f32' lacks a dtype, a shape or its data "
                              "offsets)")

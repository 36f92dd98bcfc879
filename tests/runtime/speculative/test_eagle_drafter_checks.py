"""Drafters an engine refuses at load, naming what does not fit: sliding-window layers that fail
the one-group check, a d2t or t2d that maps outside the target's vocabulary or is of another
length, other widths or head sizes, a damaged weights file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.kv.groups import KVCacheGroupError
from runtime.speculative.loader import DrafterMismatchError
from tests.drafter_fixtures import make_random_drafter
from tests.fixtures import make_tiny_checkpoint


def test_drafter_with_sliding_window_layers_fails_group_check_naming_layers(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = make_random_drafter(
        tiny_model_dir, tmp_path / "mixed", num_layers=3, style="eagle1", sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"])
    with pytest.raises(KVCacheGroupError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    message = str(err.value)
    for name in ("layers.2", "layers.3", "layers.4"):
        assert name in message
    assert "sliding_window=8" in message


def test_a_qwen2_style_drafter_config_gets_windows_from_max_window_layers(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Without layer_types, a config's max_window_layers says which layers have windows (from
    that layer up), as transformers' Qwen2Config reads it: mixed layers fail the group check,
    and a one-layer drafter below max_window_layers (copied from a 28-layer target) has none."""
    qwen2_style = {"use_sliding_window": True, "sliding_window": 8}
    mixed = make_random_drafter(tiny_model_dir, tmp_path / "mixed", num_layers=2,
                                max_window_layers=1, **qwen2_style)
    assert "layer_types" not in json.loads((mixed / "config.json").read_text())
    with pytest.raises(KVCacheGroupError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(mixed)))
    assert "sliding_window=8" in str(err.value)
    below = make_random_drafter(tiny_model_dir, tmp_path / "below", num_layers=1,
                                max_window_layers=28, **qwen2_style)
    above = make_random_drafter(tiny_model_dir, tmp_path / "above", num_layers=1,
                                max_window_layers=0, **qwen2_style)
    for drafter, window in ((below, None), (above, 8)):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                     kv_cache_memory=1 << 20, drafter=str(drafter),
                                     max_model_len=64))
        assert engine.proposer is not None
        layers = engine.proposer.drafter.layers
        assert [layer.self_attn.backend.sliding_window for layer in layers] == [window]


@pytest.mark.parametrize("shift, first", [(-1000, 5), (10_000, 7)])
def test_a_d2t_that_maps_outside_the_target_vocabulary_is_refused_at_load(
        tiny_model_dir: Path, tmp_path: Path, shift: int, first: int) -> None:
    """Caught when the drafter loads, not hours into a job when it first drafts that token."""
    from safetensors.torch import load_file, save_file

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d2t", num_layers=1,
                                  style="eagle3", draft_vocab_size=40)
    tensors = load_file(str(drafter / "model.safetensors"))
    tensors["d2t"][first] += shift
    tensors["d2t"][first + 3] += shift
    save_file(tensors, str(drafter / "model.safetensors"))
    mapped = first + int(tensors["d2t"][first])
    with pytest.raises(DrafterMismatchError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    assert str(err.value) == (f"drafter {drafter}: d2t maps draft token {first} to target token "
                              f"{mapped}, outside the target's vocabulary of 256 (2 draft "
                              "token(s) map outside it)")


def test_a_d2t_of_another_length_than_the_draft_head_is_refused(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "short", num_layers=1,
                                  style="eagle3", draft_vocab_size=40)
    tensors = load_file(str(drafter / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"][:39].clone()
    save_file(tensors, str(drafter / "model.safetensors"))
    with pytest.raises(DrafterMismatchError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    assert str(err.value) == (f"drafter {drafter}: d2t has shape (39,) but lm_head.weight has 40 "
                              "rows (expected one d2t entry per draft token)")


def test_drafter_that_does_not_fit_names_the_field(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_checkpoint(tmp_path / "wide", hidden_size=96, num_heads=6, num_kv_heads=2)
    drafter = make_random_drafter(other, tmp_path / "wide-drafter", num_layers=1)
    with pytest.raises(DrafterMismatchError, match="hidden_size is 96 in the drafter but 64"):
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    # heads of another size (the target's 4 heads are of 16); other head counts do fit
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "head-dim", num_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    with pytest.raises(DrafterMismatchError, match=re.escape(
            f"drafter {drafter} does not fit the target: head_dim is 32 in the drafter but 16 in "
            "the target")):
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))


def test_drafter_with_a_damaged_weights_file_names_the_file(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "damaged", num_layers=1)
    weights = next(drafter.glob("*.safetensors"))
    weights.write_bytes(b"\x08" + b"\0" * 7 + b"garbage!")
    with pytest.raises(DrafterMismatchError, match=f"drafter {drafter}: cannot read "
                                                   f"{weights.name} \\("):
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))

"""Drafters saved in the speculators layout (vLLM reads it): nested config, other weight names,
EAGLE-3's norm_before_residual. Each loads to exactly the drafter of the plain layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import Completion
from runtime.speculative.loader import (
    DrafterMismatchError,
    drafter_num_layers,
    load_drafter_checkpoint,
)
from runtime.speculative.train_init import load_init_drafter
from tests.drafter_fixtures import generate_greedy as generate
from tests.drafter_fixtures import make_random_drafter

EAGLE_FIELDS = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "architectures")


def to_speculators(plain: Path, out: Path, kind: str, **top: object) -> Path:
    """Rewrites a plain-layout drafter the way speculators saves it, with the verifier's
    embedding (and, for "eagle", LM head) copies it keeps beside the drafter."""
    raw = json.loads((plain / "config.json").read_text())
    # speculators may keep the verifier's whole config here: its layer count is not the drafter's
    layer = {k: v for k, v in raw.items() if k not in EAGLE_FIELDS} | {"num_hidden_layers": 30}
    config: dict[str, object] = {
        "speculators_model_type": kind, "speculators_version": "0.2.0",
        "architectures": ["Eagle3Speculator" if kind == "eagle3" else "EagleSpeculator"],
        "transformer_layer_config": layer,
        "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "tiny", "architectures": []}}}
    if kind == "eagle3":
        config.update(draft_vocab_size=raw["draft_vocab_size"],
                      eagle_aux_hidden_state_layer_ids=raw["eagle_aux_hidden_state_layer_ids"])
    else:
        config.update(layernorms=False, fusion_bias=True)
    config.update(top)
    tensors = load_file(str(plain / "model.safetensors"))
    vocab, hidden = raw["vocab_size"], raw["hidden_size"]
    g = torch.Generator().manual_seed(99)
    if kind == "eagle":
        tensors = {k.replace("fc.", "fusion_fc.").replace("layers.0.", "transformer."): v
                   for k, v in tensors.items()}
        tensors["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    else:
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def signature(out: dict[str, Completion]) -> dict[str, tuple]:
    return {k: (tuple(c.token_ids), c.num_drafted, c.num_accepted, tuple(c.accepted_per_position))
            for k, c in out.items()}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_speculators_layout_loads_the_same_drafter_as_the_plain_one(
        tiny_model_dir: Path, tmp_path: Path, kind: str) -> None:
    style = "eagle3" if kind == "eagle3" else "eagle1"
    extra = {"draft_vocab_size": 100, "aux_layer_ids": (0, 1, 1)} if style == "eagle3" else {}
    plain = make_random_drafter(tiny_model_dir, tmp_path / "plain", num_layers=1, style=style,
                                seed=3, **extra)  # type: ignore[arg-type]
    nested = to_speculators(plain, tmp_path / "speculators", kind)
    target = AutoConfig.from_pretrained(tiny_model_dir)
    a, b = load_drafter_checkpoint(plain, target), load_drafter_checkpoint(nested, target)
    assert (b.style, b.aux_layer_ids, b.config.num_hidden_layers) == \
        (a.style, a.aux_layer_ids, a.config.num_hidden_layers)
    assert sorted(b.state_dict) == sorted(a.state_dict)  # the verifier's copies are dropped
    assert drafter_num_layers(nested) == drafter_num_layers(plain) == 1
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert not getattr(b.config, "norm_before_residual", False)

    baseline = generate(tiny_model_dir, None)
    with_plain, with_nested = generate(tiny_model_dir, plain), generate(tiny_model_dir, nested)
    # the same drafts, accepted the same way, and the target's own tokens
    assert signature(with_nested) == signature(with_plain)
    assert {k: c.token_ids for k, c in with_nested.items()} == \
        {k: c.token_ids for k, c in baseline.items()}
    assert sum(c.num_drafted for c in with_nested.values()) > 0


def test_norm_before_residual_makes_layer_zero_add_to_the_normed_feature(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    plain = make_random_drafter(tiny_model_dir, tmp_path / "plain", num_layers=2, style="eagle3",
                                seed=4, draft_vocab_size=100, aux_layer_ids=(0, 1, 1))
    tensors = load_file(str(plain / "model.safetensors"))
    tensors["layers.0.hidden_norm.weight"] = torch.linspace(0.5, 2.0, 64)  # not the identity
    save_file(tensors, str(plain / "model.safetensors"))
    nested = to_speculators(plain, tmp_path / "nbr", "eagle3", norm_before_residual=True)

    engine = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4,
                                 kv_cache_memory=1 << 20, drafter=str(nested)))
    assert engine.proposer is not None
    drafter = engine.proposer.drafter
    assert drafter.norm_before_residual and len(drafter.layers) == 2
    features = torch.randn(3, 3 * 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([7, 8, 9])
    with torch.no_grad():
        x, residual = drafter.layer_inputs(ids, features)
        fc_out = drafter.fc(features)
        normed = drafter.hidden_norm(fc_out)
        embeds = drafter.embed_norm(engine.model.model.embed_tokens(ids))
    assert torch.equal(residual, normed) and not torch.equal(residual, fc_out)
    assert torch.equal(x, torch.cat((embeds, normed), dim=-1))

    # lossless with it; an init drafter for training it is refused
    out = generate(tiny_model_dir, nested)
    assert {k: c.token_ids for k, c in out.items()} == \
        {k: c.token_ids for k, c in generate(tiny_model_dir, None).items()}
    with pytest.raises(ValueError, match="norm_before_residual"):
        load_init_drafter(nested, "eagle3", 2, AutoConfig.from_pretrained(tiny_model_dir))


@pytest.mark.parametrize(("change", "message"), [
    ({"speculators_model_type": "mlp_speculator"},
     "speculators_model_type 'mlp_speculator' is not an EAGLE drafter"),
    ({"transformer_layer_config": None}, "without a transformer_layer_config"),
    ({"layernorms": True}, "layernorms is true"),
])
def test_speculators_layouts_it_cannot_run_get_an_error_naming_the_field(
        tiny_model_dir: Path, tmp_path: Path, change: dict, message: str) -> None:
    plain = make_random_drafter(tiny_model_dir, tmp_path / "plain", num_layers=1)
    nested = to_speculators(plain, tmp_path / "speculators", "eagle", **change)
    with pytest.raises(DrafterMismatchError, match=message) as err:
        load_drafter_checkpoint(nested, AutoConfig.from_pretrained(tiny_model_dir))
    assert str(nested / "config.json") in str(err.value)

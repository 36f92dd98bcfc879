"""The drafter a training starts from (the target's last layers, or a trained drafter to
fine-tune), its vocabularies, and the files it ends in (config.json + model.safetensors, in the
public layout)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from runtime.kv.groups import draft_layer_name
from runtime.loader import load_state_dict
from runtime.model import CausalLM, head_dim_of
from runtime.rope import RotaryEmbedding
from runtime.speculative.checkpoint import drafter_config_dict
from runtime.speculative.drafter import EagleDrafter
from runtime.speculative.loader import (
    DrafterCheckpoint,
    load_drafter_checkpoint,
    to_public_names,
)

if TYPE_CHECKING:
    from runtime.speculative.train_job import TrainDrafterJob


def load_target(model_dir: Path, config: Any) -> CausalLM:
    target = CausalLM(config, "torch", config.max_position_embeddings)
    target.untie_head()  # a head of other values that a tied checkpoint holds is its head
    target.tie_head(target.load_weights(load_state_dict(model_dir, torch.float32)), model_dir)
    target.requires_grad_(False)
    return target.eval()


def build_drafter(target: CausalLM, job: TrainDrafterJob, vocab: torch.Tensor,
                  **shape: int) -> EagleDrafter:
    """shape: config fields that differ from the target's (num_attention_heads, head_dim, ...)."""
    from transformers import LlamaConfig  # noqa: PLC0415

    raw = drafter_config_dict(target.config, job.num_layers, job.style, len(vocab), None, **shape)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    n = target.config.num_hidden_layers
    names = [draft_layer_name(n, i) for i in range(job.num_layers)]
    torch.manual_seed(job.train.seed)
    drafter = EagleDrafter(config, job.style, target, names, "torch", fc_bias=job.style == "eagle1",
                           windows=[None] * job.num_layers)
    drafter.rope = RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings + 8)
    if job.init_drafter is not None:
        init_from_drafter(drafter, job.init_drafter, target.config)
    elif job.init_from_target:
        init_from_target(drafter, target)
    if job.style == "eagle3":
        with torch.no_grad():
            head = drafter.lm_head.weight
            assert isinstance(head, torch.Tensor)
            head.copy_(target.head_weight[vocab])
            drafter.norm.weight.copy_(target.model.norm.weight)
            drafter.d2t.copy_(d2t_of(vocab))
    return drafter


def init_from_target(drafter: EagleDrafter, target: CausalLM, out_scale: float = 0.05) -> None:
    """Draft layer i starts as target layer L - N + i, its output projections (o_proj, down_proj)
    scaled by out_scale: the target's layers write into a residual stream far larger than the
    normed feature the drafter works in. EAGLE-1's fc starts as [0.1 W | I], so the drafter
    starts close to "the next feature is this one" plus a little of the next token."""
    n, layers = len(drafter.layers), target.model.layers
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            source = layers[len(layers) - n + i].state_dict()
            mine = layer.state_dict()
            scaled = {k: v * out_scale if k.endswith(("o_proj.weight", "down_proj.weight")) else v
                      for k, v in source.items() if k in mine and mine[k].shape == v.shape}
            layer.load_state_dict(scaled, strict=False)
        if drafter.style == "eagle1":
            h = drafter.fc.weight.shape[0]
            drafter.fc.weight[:, :h].mul_(0.1)
            drafter.fc.weight[:, h:].copy_(torch.eye(h))
            drafter.fc.bias.zero_()


def load_init_drafter(path: Path, style: str, num_layers: int, target_config: Any
                      ) -> DrafterCheckpoint:
    """The drafter to fine-tune from, checked against the target and the job's style and layer
    count (ValueError / FileNotFoundError naming the path)."""
    ckpt = load_drafter_checkpoint(path, target_config)
    if ckpt.style != style or ckpt.config.num_hidden_layers != num_layers:
        raise ValueError(f"--init-drafter {path} is {ckpt.style} with "
                         f"{ckpt.config.num_hidden_layers} layers; this job trains "
                         f"{style} with {num_layers}")
    # this job trains drafters shaped as the target's layers (a head_dim of the drafter's own is
    # refused by load_drafter_checkpoint already)
    shape = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    mine = [getattr(ckpt.config, f) for f in shape]
    theirs = [getattr(target_config, f) for f in shape]
    if mine != theirs:
        differ = ", ".join(f"{f} {a} (the target's: {b})" for f, a, b in
                           zip(shape, mine, theirs, strict=True) if a != b)
        raise ValueError(f"--init-drafter {path} has {differ}; this job trains drafters whose "
                         "layers have the target's shape")
    if getattr(ckpt.config, "norm_before_residual", False):
        raise ValueError(f"--init-drafter {path} sets norm_before_residual (an EAGLE-3 variant "
                         "this job does not train); start from a drafter without it")
    return ckpt


def init_from_drafter(drafter: EagleDrafter, path: Path, target_config: Any) -> None:
    """Start from a trained drafter's layers and fc (fine-tuning, e.g. on more data); its own
    head, if any, is left out: the job derives the head from the target (an EAGLE-3 head over
    this run's draft vocabulary, which may be another than the drafter's)."""
    ckpt = load_init_drafter(path, drafter.style, len(drafter.layers), target_config)
    head = ("lm_head.weight", "d2t", "norm.weight")  # (an EAGLE-3 head: build_drafter's)
    state = {k: v.float() if v.is_floating_point() else v
             for k, v in ckpt.state_dict.items() if k not in head}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in head]
    if missing or unexpected:
        raise ValueError(f"--init-drafter {path}: missing {missing}, unexpected {unexpected}")


def frequent_tokens(rows: Sequence[dict[str, Any]], size: int) -> torch.Tensor:
    """[size] the most frequent answer token ids (ties by id), sorted ascending."""
    counts = Counter(t for r in rows for t in r["answer_ids"])
    top = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    rest = (t for t in range(10**9) if t not in counts)
    top += [next(rest) for _ in range(size - len(top))]
    return torch.tensor(sorted(top), dtype=torch.int64)


def d2t_of(vocab: torch.Tensor) -> torch.Tensor:
    """[len(vocab)] offsets such that target id = draft id + d2t[draft id] (`vocab` sorted)."""
    return (vocab - torch.arange(len(vocab))).to(torch.int64)


def t2d_of(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] target id -> index in `vocab`, or -1."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
    t2d[vocab] = torch.arange(len(vocab))
    return t2d


def save_drafter(out_dir: Path, config: dict, drafter: EagleDrafter, style: str,
                 dtype: torch.dtype, extra: dict[str, torch.Tensor] | None = None) -> None:
    """config.json + model.safetensors in the public layout (plus `extra` tensors, already in
    public names), each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {**to_public_names(drafter.state_dict(), style), **(extra or {})}
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
               for k, v in state.items()}
    tmp = out_dir / ".model.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, out_dir / "model.safetensors")
    (out_dir / ".config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(out_dir / ".config.json.tmp", out_dir / "config.json")


def draft_head(target: CausalLM, vocab: torch.Tensor) -> dict[str, torch.Tensor]:
    """An EAGLE-1 drafter's own LM head: the target's head rows of `vocab` (sorted target ids)
    as lm_head.weight, and d2t. Each draft step then reads len(vocab) rows instead of the whole
    vocabulary; drafts are limited to those tokens (verification keeps the output exact)."""
    return {"lm_head.weight": target.head_weight.detach()[vocab], "d2t": d2t_of(vocab)}

"""Writing drafter checkpoints in the public EAGLE layout (config.json + model.safetensors)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from runtime.speculative.loader import to_public_names

# Per-layer fields copied from the target into a new drafter's config.
_SHARED_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                  "rope_parameters", "rope_theta", "hidden_act", "bos_token_id", "eos_token_id")


def drafter_config_dict(target: PretrainedConfig, num_layers: int, style: str,
                        draft_vocab_size: int | None = None,
                        aux_layer_ids: tuple[int, ...] | None = None, **overrides: object) -> dict:
    """A Llama-style config.json for a drafter of `num_layers` layers on `target`."""
    raw = target.to_dict()
    config = {k: raw[k] for k in _SHARED_FIELDS if raw.get(k) is not None}
    config.update(model_type="llama", num_hidden_layers=num_layers, tie_word_embeddings=False,
                  architectures=["LlamaForCausalLMEagle3" if style == "eagle3" else "EagleLlama"])
    if style == "eagle3":
        config["draft_vocab_size"] = draft_vocab_size or target.vocab_size
        if aux_layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    config.update(overrides)
    return config


def save_drafter_checkpoint(out_dir: Path, config: dict, state: dict[str, torch.Tensor],
                            style: str, dtype: torch.dtype = torch.float32) -> Path:
    """Writes config.json + model.safetensors into out_dir atomically (temp dir, then rename).
    state uses EagleDrafter's parameter names; they are saved under the public ones."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700: others could not read the drafter
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in to_public_names(state, style).items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "model.safetensors").chmod(0o666 & ~umask)
    for extra in out_dir.glob("*") if out_dir.is_dir() else []:
        if extra.name not in ("config.json", "model.safetensors") and extra.is_file():
            shutil.copy2(extra, tmp / extra.name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir

"""Reading EAGLE drafter checkpoints in the layouts public checkpoints and other engines use.

A directory with a Llama-style config.json (num_hidden_layers = N) and model.safetensors or
pytorch_model.bin holding:
    fc.weight [H, 2H] (EAGLE-1) or [H, 3H] (EAGLE-3), optional fc.bias
    layers.{i}.*            decoder layers (EAGLE-1 layer 0 has no input_layernorm)
    midlayer.*              the single layer of a one-layer EAGLE-3 checkpoint (= layers.0.*)
    layers.0.input_layernorm / hidden_norm   EAGLE-3's norms of the embedding and the feature
    norm.weight, lm_head.weight [draft_vocab, H], d2t [draft_vocab]   (EAGLE-3)
Keys may carry a "model." prefix; embed_tokens is ignored (the embedding is the target's), and
so is t2d, except in a checkpoint that has no d2t: its d2t is then read off t2d (a mask over the
target's vocabulary marking the draft tokens, in draft-token order).

The speculators layout (config.json with `speculators_model_type`, read by vLLM) is read too:
its Llama fields sit under `transformer_layer_config`, the EAGLE fields (draft_vocab_size,
norm_before_residual, eagle_aux_hidden_state_layer_ids) at the top. Its "eagle3" weights use the
names above; its "eagle" (EAGLE-1 / HASS) weights are `fusion_fc.*` (= fc) and `transformer.*`
(= layers.0), beside copies of the verifier's embedding and LM head, which are ignored.
EAGLE-3's `norm_before_residual` (layer 0 adds its attention output to hidden_norm(fc out)
instead of fc out) is honoured whatever the layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, PretrainedConfig

from runtime.loader import read_bin_shard, weight_files
from runtime.model import check_layer_config, head_dim_of
from runtime.speculative.draft_vocab import DrafterMismatchError, check_vocab, d2t_from_t2d

IGNORED_KEYS = ("embed_tokens.weight", "t2d")
_SPECULATORS_TOP_FIELDS = ("draft_vocab_size", "norm_before_residual", "target_hidden_size",
                           "eagle_aux_hidden_state_layer_ids")
_REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size")


class DrafterCheckpoint(NamedTuple):
    config: PretrainedConfig
    style: str  # eagle1 | eagle3
    state_dict: dict[str, torch.Tensor]  # names of EagleDrafter's parameters
    aux_layer_ids: tuple[int, ...]  # target layers whose input feeds EAGLE-3 ((): EAGLE-1)


def load_drafter_checkpoint(path: Path, target_config: PretrainedConfig) -> DrafterCheckpoint:
    if not path.exists():
        raise FileNotFoundError(f"drafter {path}: no such directory")
    if not path.is_dir():
        raise FileNotFoundError(f"drafter {path} is a file; expected an EAGLE checkpoint "
                                "directory with config.json and model.safetensors")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"drafter {path}: no config.json (expected an EAGLE checkpoint "
                                "directory with config.json and model.safetensors)")
    raw = read_drafter_config(path)
    # every public layout's vocab_size is the target's; LlamaConfig's default (32000) is not
    raw.setdefault("vocab_size", target_config.vocab_size)
    tensors = _read_tensors(path)
    if raw.get("speculators_model_type") == "eagle":
        tensors = _from_speculators_eagle(tensors)
    _check_dtypes(tensors, path)
    style = _style(tensors, target_config, path)
    if "d2t" not in tensors and "t2d" in tensors:
        tensors["d2t"] = d2t_from_t2d(tensors, target_config.vocab_size, path)
    _check_eagle_fields(raw, path / "config.json")
    check_vocab(raw, tensors, style, target_config, path)
    state = _rename(tensors, style)
    in_weights = _layer_count(state)
    # the speculators layout's layer config may be the verifier's whole config; a config without
    # num_hidden_layers would get LlamaConfig's default (32)
    layers = {"num_hidden_layers": in_weights} if (
        "speculators_model_type" in raw or "num_hidden_layers" not in raw) else {}
    config = _llama_config(raw | _attention_from_weights(state) | layers, path / "config.json")
    check_fit(config, state, style, target_config, path)
    aux = _aux_layer_ids(raw, style, target_config.num_hidden_layers, path)
    return DrafterCheckpoint(config, style, state, aux)


def _check_dtypes(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Weights are floating point, d2t integers, t2d flags or integers: a tensor of another
    dtype (an int8 weight without its scales, a float or bool d2t) would be cast without a
    word and draft nonsense."""
    for key, value in tensors.items():
        if key == "d2t":
            ok = not value.is_floating_point() and value.dtype != torch.bool
            expected = "integers (target id = draft id + d2t[draft id])"
        elif key == "t2d":
            ok = not value.is_floating_point()
            expected = "booleans or integers (which target ids are draft tokens)"
        else:
            ok = value.is_floating_point()
            expected = "floating point (quantized checkpoints are not supported)"
        if not ok:
            raise DrafterMismatchError(f"drafter {path}: {key} has dtype "
                                       f"{str(value.dtype).removeprefix('torch.')}; expected "
                                       f"{expected}")


def _check_eagle_fields(raw: dict, where: Path) -> None:
    """The EAGLE fields of config.json that the layers' config does not check: a string
    "false" would turn norm_before_residual on, and a draft_vocab_size that is not a count
    would skip the check against the head."""
    value = raw.get("norm_before_residual")
    if value is not None and not isinstance(value, bool):
        raise DrafterMismatchError(f"drafter {where}: norm_before_residual is {value!r}; "
                                   "expected true or false")
    value = raw.get("draft_vocab_size")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise DrafterMismatchError(f"drafter {where}: draft_vocab_size is {value!r}; expected a "
                                   "positive integer")


def _llama_config(raw: dict, where: Path) -> LlamaConfig:
    """The drafter's layers' config. A config copied from its target may carry the target's
    `layer_types` (one per target layer; transformers writes them into every Qwen2 / Qwen3
    config): the drafter's layers take the first ones."""
    missing = [k for k in _REQUIRED_FIELDS if raw.get(k) is None]
    if missing:
        raise DrafterMismatchError(f"drafter {where}: no {', '.join(missing)} (an EAGLE "
                                   "drafter's config.json describes its decoder layers)")
    fields = {k: v for k, v in raw.items() if k != "architectures"}
    layers = fields.get("num_hidden_layers", 1)
    types = fields.get("layer_types")
    bottom = fields.get("max_window_layers")
    if types is None and isinstance(bottom, int) and isinstance(layers, int):
        # a Qwen2-style config without layer_types: windows from layer max_window_layers up,
        # as transformers' Qwen2Config gives them (the Llama config read here would not)
        windowed = fields.get("use_sliding_window", True) is not False \
            and fields.get("sliding_window") is not None
        fields["layer_types"] = ["sliding_attention" if windowed and i >= bottom
                                 else "full_attention" for i in range(layers)]
    if isinstance(types, list) and isinstance(layers, int) and len(types) != layers:
        if len(types) > layers:
            fields["layer_types"] = types[:layers]
        else:
            del fields["layer_types"]
    try:
        config = LlamaConfig(**fields)
    except Exception as exc:  # transformers' validation errors are not all ValueErrors
        raise DrafterMismatchError(f"drafter {where}: not a valid layer config ({exc})") from None
    config.architectures = raw.get("architectures")
    try:
        check_layer_config(config, f"drafter {where}", any_architecture=True)
    except ValueError as exc:
        raise DrafterMismatchError(str(exc)) from None
    return config


def _attention_from_weights(state: dict[str, torch.Tensor]) -> dict[str, object]:
    """The config fields that give the drafter's attention the biases and q/k norms its weights
    have: configs do not say reliably (a drafter of a Qwen2 target may carry q/k/v biases under
    model_type llama; one of a Qwen3 target is often model_type llama without q/k norms, or
    qwen3 without them)."""
    attn = "layers.0.self_attn."
    qkv_bias = attn + "q_proj.bias" in state
    o_bias = attn + "o_proj.bias" in state
    if attn + "q_norm.weight" in state:
        return {"model_type": "qwen3", "attention_bias": qkv_bias}
    if qkv_bias and not o_bias:
        return {"model_type": "qwen2", "attention_bias": False}
    # (a bias on o_proj alone: the weights' check then names the missing q/k/v biases)
    return {"model_type": "llama", "attention_bias": qkv_bias or o_bias}


def read_drafter_config(path: Path) -> dict:
    """The drafter's config.json as one flat Llama-style dict (speculators layout unfolded; its
    `speculators_model_type` is kept so the weights' names can be read accordingly)."""
    where = path / "config.json"
    try:
        raw = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise DrafterMismatchError(f"drafter {where}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise DrafterMismatchError(f"drafter {where}: expected a JSON object")
    kind = raw.get("speculators_model_type")
    if kind is None:
        return raw
    if kind not in ("eagle", "eagle3"):
        raise DrafterMismatchError(f"drafter {where}: speculators_model_type {kind!r} is not an "
                                   "EAGLE drafter (supported: eagle, eagle3)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterMismatchError(f"drafter {where}: speculators layout without a "
                                   "transformer_layer_config object")
    if kind == "eagle" and raw.get("layernorms"):
        raise DrafterMismatchError(f"drafter {where}: layernorms is true (extra norms around the "
                                   "fusion layer and before the LM head); only EAGLE-1 / HASS "
                                   "drafters without them (layernorms false) are supported")
    flat = dict(layer)
    flat.update({k: raw[k] for k in _SPECULATORS_TOP_FIELDS if raw.get(k) is not None})
    flat["speculators_model_type"] = kind
    return flat


def drafter_num_layers(path: Path) -> int:
    """The drafter's decoder layer count, from its weights' names as the loader counts them
    (safetensors: from the headers, without reading the tensors; pytorch_model*.bin: loaded)."""
    files = weight_files(path)
    if not files or files[0].suffix != ".safetensors":
        return _layer_count(_read_tensors(path))
    keys: list[str] = []
    for f in files:
        try:
            opened = safe_open(str(f), "pt")
        except SafetensorError as exc:
            raise _unreadable(path, f, exc) from None
        with opened as handle:
            keys += handle.keys()
    return _layer_count(k.removeprefix("model.") for k in keys)


def _layer_count(keys: Iterable[str]) -> int:
    """How many decoder layers a checkpoint's tensor names (without "model.") hold: layers.N.*,
    or one as midlayer.* (SGLang) or transformer.* (speculators' EAGLE-1)."""
    layers: set[str] = set()
    for key in keys:
        if key.startswith(("midlayer.", "transformer.")):
            layers.add("0")
        elif key.startswith("layers."):
            layers.add(key.split(".")[1])
    return len(layers)


def _from_speculators_eagle(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' EAGLE-1 names to the public ones; its copies of the verifier's embedding and
    LM head (saved beside the drafter) are dropped: the target's own are used."""
    out = {}
    for key, value in tensors.items():
        if key in ("embed_tokens.weight", "lm_head.weight") or key.startswith("verifier"):
            continue
        if key.startswith("fusion_fc."):
            key = "fc." + key.removeprefix("fusion_fc.")
        elif key.startswith("transformer."):
            key = "layers.0." + key.removeprefix("transformer.")
        out[key] = value
    return out


def _unreadable(path: Path, file: Path, exc: Exception) -> DrafterMismatchError:
    return DrafterMismatchError(f"drafter {path}: cannot read {file.name} ({exc})")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: its safetensors files, else its pytorch_model*.bin files (a
    training run's optimizer.bin or scheduler.bin beside them are not read)."""
    files = weight_files(path)
    if not files:
        others = sorted(f.name for f in path.glob("*.bin"))
        raise FileNotFoundError(f"drafter {path}: no *.safetensors or pytorch_model*.bin weights"
                                + (f" (not weights: {', '.join(others)})" if others else ""))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)) if f.suffix == ".safetensors" else read_bin_shard(f))
        except SafetensorError as exc:
            raise _unreadable(path, f, exc) from None
        except ValueError as exc:  # read_bin_shard's, naming the file
            raise DrafterMismatchError(f"drafter {exc}") from None
    return {k.removeprefix("model."): v for k, v in out.items()}


def _style(tensors: dict[str, torch.Tensor], target: PretrainedConfig, path: Path) -> str:
    if "fc.weight" not in tensors:
        raise DrafterMismatchError(f"drafter {path}: no fc.weight; not an EAGLE checkpoint")
    if tensors["fc.weight"].dim() != 2:
        raise DrafterMismatchError(f"drafter {path}: fc.weight has shape "
                                   f"{tuple(tensors['fc.weight'].shape)}; expected [H, 2H] "
                                   "(EAGLE-1) or [H, 3H] (EAGLE-3)")
    out_size, in_size = tensors["fc.weight"].shape
    if in_size in (2 * out_size, 3 * out_size):
        return "eagle3" if in_size == 3 * out_size else "eagle1"
    features, width = in_size // target.hidden_size, target.hidden_size
    if in_size in (2 * width, 3 * width):
        raise DrafterMismatchError(
            f"drafter {path}: fc.weight maps {features} target features of {width} to "
            f"{out_size}; drafters narrower or wider than their target (target_hidden_size != "
            "hidden_size) are not supported")
    raise DrafterMismatchError(f"drafter {path}: fc.weight has shape "
                               f"{tuple(tensors['fc.weight'].shape)}; expected [H, 2H] "
                               "(EAGLE-1) or [H, 3H] (EAGLE-3)")


def _rename(tensors: dict[str, torch.Tensor], style: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if (key in IGNORED_KEYS or key.startswith("verifier")  # speculators' training extras
                or key.endswith("rotary_emb.inv_freq")):  # a buffer older transformers saved
            continue
        key = "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key
        if style == "eagle3" and key == "layers.0.input_layernorm.weight":
            key = "embed_norm.weight"
        elif style == "eagle3" and key == "layers.0.hidden_norm.weight":
            key = "hidden_norm.weight"
        state[key] = value
    return state


def to_public_names(state: dict[str, torch.Tensor], style: str) -> dict[str, torch.Tensor]:
    """The inverse of _rename, for saving trained drafters in the public layout."""
    names = {"embed_norm.weight": "layers.0.input_layernorm.weight",
             "hidden_norm.weight": "layers.0.hidden_norm.weight"} if style == "eagle3" else {}
    return {names.get(k, k): v for k, v in state.items()}


def check_fit(config: PretrainedConfig, state: dict[str, torch.Tensor], style: str,
              target: PretrainedConfig, path: Path) -> None:
    def mismatch(field: str, mine: object, theirs: object) -> DrafterMismatchError:
        return DrafterMismatchError(f"drafter {path} does not fit the target: {field} is {mine} "
                                    f"in the drafter but {theirs} in the target")

    if config.hidden_size != target.hidden_size:
        raise mismatch("hidden_size", config.hidden_size, target.hidden_size)
    # The number of heads and KV heads may differ from the target's (the draft layers then form
    # a KV cache group of their own, over the same block table: runtime.setup); head_dim may not
    if head_dim_of(config) != head_dim_of(target):
        raise mismatch("head_dim", head_dim_of(config), head_dim_of(target))
    shares_head = "lm_head.weight" not in state
    if shares_head and config.vocab_size != target.vocab_size:
        raise mismatch("vocab_size", config.vocab_size, target.vocab_size)
    if shares_head:  # drafts from the target's norm and head, over its whole vocabulary
        for key in ("d2t", "norm.weight"):
            state.pop(key, None)
    else:
        d2t = state.get("d2t")
        draft_vocab = state["lm_head.weight"].shape[0]
        if d2t is None and draft_vocab != target.vocab_size:
            raise mismatch("draft vocabulary (no d2t or t2d)", draft_vocab, target.vocab_size)
        if d2t is not None and tuple(d2t.shape) != (draft_vocab,):
            raise DrafterMismatchError(
                f"drafter {path}: d2t has shape {tuple(d2t.shape)} but lm_head.weight has "
                f"{draft_vocab} rows (expected one d2t entry per draft token)")
        if d2t is not None:
            mapped = torch.arange(len(d2t)) + d2t
            bad = ((mapped < 0) | (mapped >= target.vocab_size)).nonzero().flatten()
            if len(bad):
                i = int(bad[0])
                raise DrafterMismatchError(
                    f"drafter {path}: d2t maps draft token {i} to target token {int(mapped[i])}, "
                    f"outside the target's vocabulary of {target.vocab_size} ({len(bad)} draft "
                    "token(s) map outside it)")
        config.draft_vocab_size = draft_vocab
        state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.int64))


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's aux layers where a config names none: (2, L/2, L-3), as EAGLE's and vLLM's."""
    return (2, num_layers // 2, num_layers - 3)


def _aux_layer_ids(raw: dict, style: str, num_layers: int, path: Path) -> tuple[int, ...]:
    if style != "eagle3":
        return ()
    nested = raw.get("eagle_config")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (
        nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None)
    where = "eagle_aux_hidden_state_layer_ids" if ids else (
        "the default (2, L/2, L-3) for a config without eagle_aux_hidden_state_layer_ids")
    if ids and not isinstance(ids, list):
        raise DrafterMismatchError(f"drafter {path / 'config.json'}: "
                                   f"eagle_aux_hidden_state_layer_ids is {ids!r}; expected a "
                                   "list of three target layer indices, such as [2, 16, 29]")
    ids = tuple(ids) if ids else default_aux_layer_ids(num_layers)
    if len(ids) != 3 or any(not isinstance(i, int) or isinstance(i, bool)
                            or not 0 <= i < num_layers for i in ids):
        raise DrafterMismatchError(f"drafter {path}: EAGLE-3 aux layer ids {ids} ({where}) do "
                                   f"not fit a target with {num_layers} layers (need three ids "
                                   f"in 0..{num_layers - 1})")
    # the target's streams are taken in layer order, whatever order the config lists them in
    # (as vLLM and SGLang collect them: the fc's input columns follow the layers)
    return tuple(sorted(ids))

"""Convert a LLaMA-family GGUF file into a Hugging Face checkpoint directory (float32).

Weights are dequantized with the `gguf` package and renamed to Hugging Face names. The GGUF
"llama" architecture stores Q/K rows permuted for llama.cpp's interleaved rotary embedding; those
rows are put back in Hugging Face (rotate-half) order here. Config and tokenizer come from
transformers' GGUF readers; the chat template and BOS/EOS ids come from the GGUF metadata, which
is the source of truth for them.

transformers' own AutoModelForCausalLM.from_pretrained(gguf_file=...) would need `accelerate`,
which is not a dependency; the dequantization here is the same arithmetic (gguf.dequantize).
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
)

from runtime.model import SUPPORTED_MODEL_TYPES, head_dim_of

# GGUF tensor name (inside blk.N.) -> Hugging Face name (inside model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GGUFMetadata(NamedTuple):
    architecture: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a checkpoint for `gguf_path` at `out_dir` unless one is already there.

    The checkpoint is built in a temp dir next to `out_dir` and renamed into place, so `out_dir`
    either does not exist or is complete, even if this process dies half way.
    """
    if (out_dir / "config.json").is_file():
        return out_dir
    print(f"eaglebatch: converting {gguf_path.name} to a float32 checkpoint once "
          f"(cached in {out_dir})", file=sys.stderr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_checkpoint(gguf_path, tmp)
        _make_readable(tmp)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _make_readable(tmp: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; a cache is shared like ~/.cache."""
    tmp.chmod(0o755)
    for file in tmp.iterdir():
        file.chmod(0o644)


def _publish(tmp: Path, out_dir: Path) -> None:
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another process published the same conversion first; keep theirs.
        if not (out_dir / "config.json").is_file():
            raise


def write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json."""
    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{gguf_path}: GGUF model type {config.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    config.bos_token_id = meta.bos_token_id
    config.eos_token_id = meta.eos_token_id
    head_dim = _field(reader, f"{meta.architecture}.attention.key_length")
    if head_dim is not None:  # transformers' GGUF config reader leaves Qwen3's at its default
        config.head_dim = int(head_dim)
    config.dtype = torch.float32
    permute_qk = meta.architecture == "llama"
    tensors = dequantized_tensors(reader, config.num_attention_heads,
                                  config.num_key_value_heads, permute_qk)
    scaling = rope_scaling(reader, meta.architecture, gguf_path)
    rope_freqs = tensors.pop(ROPE_FREQS, None)
    if rope_freqs is not None and scaling is None:
        scaling = _llama3_scaling(rope_freqs, config, gguf_path)
        if scaling is None:  # not Llama 3's, or not told apart: llama.cpp's divisors as they are
            config.rope_freq_divisors = [float(d) for d in rope_freqs.flatten()]
    if scaling is not None:
        theta = (config.rope_parameters or {}).get("rope_theta", 10000.0)
        config.rope_parameters = {"rope_theta": theta, **scaling}
    config.architectures = [_check_against_model(config, tensors, gguf_path)]
    config.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(gguf_path, meta, out_dir)
    GenerationConfig(bos_token_id=meta.bos_token_id, eos_token_id=meta.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)


# llama.cpp stores Llama 3's RoPE scaling as this tensor of per-frequency divisors
ROPE_FREQS = "rope_freqs.weight"
_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def rope_scaling(reader: gguf.GGUFReader, arch: str, gguf_path: Path) -> dict | None:
    """The Hugging Face rope_parameters of the file's `{arch}.rope.scaling.*` keys (transformers'
    GGUF config reader drops them), or None without scaling. llama.cpp writes linear and yarn
    scaling so (and linear, in older files, as `{arch}.rope.scale_linear`)."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    # llama.cpp multiplies every rotary cos and sin by attn_factor (any scaling type; yarn's own
    # attention scale on top): not a rope_parameters field, so refused rather than dropped
    attn_factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise ValueError(f"{gguf_path}: {arch}.rope.scaling.attn_factor = {float(attn_factor):g} "
                         "(llama.cpp scales RoPE's cos and sin by it) is not supported")
    old_linear = _field(reader, f"{arch}.rope.scale_linear")
    if kind is None and old_linear is not None and float(old_linear) != 1.0:
        return {"rope_type": "linear", "factor": float(old_linear)}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor or 1.0)}
    if kind == "yarn":
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is None or factor is None:
            raise ValueError(f"{gguf_path}: yarn RoPE scaling without {arch}.rope.scaling.factor "
                             "and .original_context_length")
        params = {"rope_type": "yarn", "factor": float(factor),
                  "original_max_position_embeddings": int(original)}
        for key, name in _YARN_KEYS.items():
            if (value := _field(reader, f"{arch}.rope.scaling.{key}")) is not None:
                params[name] = float(value)
        unread = [k for k in reader.fields if k.startswith(f"{arch}.rope.scaling.yarn_")
                  and k.rsplit(".", 1)[1] not in _YARN_KEYS]
        if unread:
            raise ValueError(f"{gguf_path}: yarn RoPE scaling with {', '.join(unread)} is not "
                             "supported")
        return params
    raise ValueError(f"{gguf_path}: RoPE scaling type {kind!r} ({arch}.rope.scaling.type) is not "
                     "supported (supported: linear, yarn, and Llama 3's rope_freqs)")


def _llama3_scaling(divisors: torch.Tensor, config: PretrainedConfig,
                    gguf_path: Path) -> dict | None:
    """Llama 3's rope_parameters from llama.cpp's per-frequency divisors (inverse frequency i is
    base_i / divisors[i]): 1 for short wavelengths, `factor` for long ones, and between them
    1 / ((1 - s) / factor + s) with s = (original / wavelength - low) / (high - low). They are
    solved for with low_freq_factor 1 (every Llama 3 release's; any other gives the same
    frequencies with original and high scaled alike) and checked by recomputing the divisors;
    None where they do not give them back (the caller keeps the divisors themselves)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    head_dim = head_dim_of(config)
    theta = (config.rope_parameters or {}).get("rope_theta", 10000.0)
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    divisors = divisors.double().flatten()
    if divisors.shape != base.shape:
        raise ValueError(f"{gguf_path}: {ROPE_FREQS} has {divisors.numel()} values for "
                         f"{base.numel()} rotary frequencies")
    factor = round(float(divisors.max()), 4)
    if factor <= 1.0:
        return {"rope_type": "default"}
    wavelength = 2 * torch.pi / base
    middle = (divisors > 1.0 + 1e-6) & (divisors < factor * (1 - 1e-6))
    s = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)  # of the wavelengths between
    low, high = 1.0, 4.0  # Llama 3's, where too few wavelengths lie between the ends to tell
    if len(s) >= 2:  # s is linear in 1 / wavelength: its slope and intercept give both
        x = 1 / wavelength[middle]
        slope = float((s[-1] - s[0]) / (x[-1] - x[0]))
        intercept = float(s[0] - slope * x[0])
        if intercept >= 0:
            return None
        high = round(low - 1 / intercept, 4)  # 4.0, not 3.99999999 (the check below holds)
        original = round(slope * (high - low))
    elif len(s) == 1:
        original = round(float((s[0] * (high - low) + low) * wavelength[middle][0]))
    else:  # the shortest long wavelength is just above original / low (any context between fits)
        original = math.floor(float(wavelength[divisors >= factor * (1 - 1e-6)].min()) * low)
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
              "high_freq_factor": high, "original_max_position_embeddings": original}
    check = copy.deepcopy(config)
    check.rope_parameters = {"rope_theta": theta, **params}
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](check, torch.device("cpu"))
    if not torch.allclose(base.float() / divisors.float(), inv_freq.float(), rtol=1e-4, atol=0):
        return None
    return params


def read_metadata(reader: gguf.GGUFReader) -> GGUFMetadata:
    return GGUFMetadata(
        architecture=str(_field(reader, "general.architecture")),
        chat_template=_str_or_none(_field(reader, "tokenizer.chat_template")),
        bos_token_id=_int_or_none(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_int_or_none(_field(reader, "tokenizer.ggml.eos_token_id")),
    )


def _field(reader: gguf.GGUFReader, key: str) -> str | int | float | None:
    """A scalar or string metadata value, or None when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _str_or_none(value: str | int | float | None) -> str | None:
    return None if value is None else str(value)


def _int_or_none(value: str | int | float | None) -> int | None:
    return None if value is None else int(value)


def dequantized_tensors(reader: gguf.GGUFReader, num_heads: int, num_kv_heads: int,
                        permute_qk: bool) -> dict[str, torch.Tensor]:
    """All GGUF tensors as float32 torch tensors under Hugging Face names."""
    tensors = {}
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        weights = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if permute_qk and ".attn_q." in tensor.name:
            weights = unpermute_rotary(weights, num_heads)
        elif permute_qk and ".attn_k." in tensor.name:
            weights = unpermute_rotary(weights, num_kv_heads)
        # F32 tensors come back as read-only views of the file; copy those (only those).
        array = np.require(weights, dtype=np.float32, requirements=["C", "W"])
        name = tensor.name if tensor.name == ROPE_FREQS else hf_tensor_name(tensor.name)
        tensors[name] = torch.from_numpy(array)
    return tensors


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head, rows [0, h/2, 1, h/2+1, ...] -> [0..h)).

    weights: [num_heads * head_dim] or [num_heads * head_dim, hidden_size].
    For head_dim 4, llama.cpp stores rows (0, 2, 1, 3) of each head; this returns (0, 1, 2, 3).
    """
    half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face LLaMA-family equivalent")


def _check_against_model(config: PretrainedConfig, tensors: dict[str, torch.Tensor],
                         gguf_path: Path) -> str:
    """Check names and shapes against the transformers model; return its class name."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if found != expected:
        diff = sorted(set(found.items()) ^ set(expected.items()))[:6]
        raise ValueError(f"{gguf_path}: tensors do not match {type(model).__name__}: {diff}")
    return type(model).__name__


def _write_tokenizer(gguf_path: Path, meta: GGUFMetadata, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if meta.chat_template is not None:
        tokenizer.chat_template = meta.chat_template
    if meta.eos_token_id is not None and tokenizer.eos_token_id != meta.eos_token_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(meta.eos_token_id)
    if meta.bos_token_id is not None and tokenizer.bos_token_id != meta.bos_token_id:
        tokenizer.bos_token = tokenizer.convert_ids_to_tokens(meta.bos_token_id)
    tokenizer.save_pretrained(out_dir)

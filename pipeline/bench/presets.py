"""Random-weight checkpoints shaped like real models, for throughput measurements.

`random:<preset>` builds a Hugging Face checkpoint with the preset's architecture (layers, widths,
heads, vocabulary) and random weights, next to a byte-level tokenizer (one token per byte of UTF-8,
so it needs no download). Its outputs, and so any acceptance figure, are meaningless; its speed is
that of the real model. A preset leaves rope scaling out and caps the context at 8192 (shape only).

`random:<path>` does the same for any model whose config.json is at hand without its weights (the
file, or a checkpoint directory holding it): the config is kept as it is (rope scaling, windows,
context), except its special token ids, which become the byte tokenizer's, and any quantization.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from runtime.model import SUPPORTED_MODEL_TYPES

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                       tie_word_embeddings=True),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=32000, rope_theta=10000.0, sliding_window=4096,
                       tie_word_embeddings=False),  # v0.1: every layer windowed
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32000, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                     tie_word_embeddings=False),
}
MAX_POSITIONS = 8192
_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3; bytes follow
_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
_SHARD_BYTES = 2 << 30
# Target fields a drafter shares (its layer is Llama-style whatever the target's family).
_DRAFTER_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                   "rope_parameters", "rope_theta", "hidden_act", "bos_token_id", "eos_token_id")
_INIT_STD = 0.02


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_config(preset: str, shape: dict[str, Any] | None = None) -> PretrainedConfig:
    """The config of a preset, or of a config.json file or directory (`preset` is then a path)."""
    if preset in PRESETS:
        return AutoConfig.for_model(max_position_embeddings=MAX_POSITIONS, bos_token_id=1,
                                    eos_token_id=2, pad_token_id=3, **{**PRESETS[preset],
                                                                       **(shape or {})})
    path = Path(preset)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown preset, and no config.json at {preset}; presets: "
                         f"{', '.join(preset_names())}")
    try:
        fields = json.loads(path.read_text())
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise ValueError("not a model config (no model_type)")
        if fields["model_type"] not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {fields['model_type']!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for key in ("auto_map", "quantization_config", "architectures"):
            fields.pop(key, None)
        fields |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, **(shape or {})}
        config = AutoConfig.for_model(**fields)
    except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from None
    if config.vocab_size < len(_SPECIALS) + 256:
        raise ValueError(f"{path}: vocab_size {config.vocab_size} is below the "
                         f"{len(_SPECIALS) + 256} tokens of the byte tokenizer")
    return config


def weight_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of a model's parameters in `dtype` (a tied head counted once)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in skeleton.parameters()) * dtype.itemsize


def make_random_checkpoint(preset: str, out_dir: Path, dtype: torch.dtype, *,
                           shape: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """Write config.json, random safetensors shards (in `dtype`) and the byte-level tokenizer.

    shape overrides preset fields (tests shrink a preset with it).
    """
    config = preset_config(preset, shape)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tied = bool(config.tie_word_embeddings)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()
              if not (tied and name == "lm_head.weight")}
    _write_random_shards(shapes, out_dir, dtype, seed)
    make_byte_tokenizer(out_dir)
    return out_dir


def make_random_drafter(target_dir: Path, out_dir: Path, dtype: torch.dtype,
                        seed: int = 1) -> Path:
    """A one-layer EAGLE-1 drafter with random weights in the public checkpoint layout:
    fc.weight [H, 2H], fc.bias [H], layers.0.* (a decoder layer without input_layernorm)."""
    config = AutoConfig.from_pretrained(target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = config.to_dict()
    one_layer = {key: target[key] for key in _DRAFTER_FIELDS if target.get(key) is not None}
    one_layer |= {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False}
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**one_layer))
    one_layer["architectures"] = ["EagleLlama"]
    hidden = config.hidden_size
    shapes = {name.removeprefix("model."): tuple(p.shape)
              for name, p in skeleton.state_dict().items()
              if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    shapes |= {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,)}
    _write_random_shards(shapes, out_dir, dtype, seed, filename="model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(one_layer, indent=2) + "\n")
    return out_dir


def _write_random_shards(shapes: dict[str, tuple[int, ...]], out_dir: Path, dtype: torch.dtype,
                         seed: int, filename: str | None = None) -> None:
    """Norm weights 1, biases 0, everything else N(0, 0.02); shards of at most 2 GiB with a
    model.safetensors.index.json, or one file named `filename`. Each shard is written (and
    freed) as soon as it is full: one shard in memory at a time (an 8B model is 16-32 GB)."""
    generator = torch.Generator().manual_seed(seed)
    if filename is not None:
        save_file({name: _random_tensor(name, shape, dtype, generator)
                   for name, shape in shapes.items()}, str(out_dir / filename))
        return
    groups: list[list[str]] = [[]]  # tensor names per shard, by size
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if size and size + nbytes > _SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        shard_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: _random_tensor(name, shapes[name], dtype, generator) for name in names},
                  str(out_dir / shard_name))
        weight_map |= dict.fromkeys(names, shard_name)
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, _INIT_STD,
                                                           generator=generator).to(dtype)


def make_byte_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges: ids 0..3 are <unk> <s> </s> <pad>, then the 256
    bytes. It fits any vocabulary of at least 260 tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate((*_SPECIALS, *alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer

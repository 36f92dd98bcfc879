"""Tiny real checkpoints and tokenizers, built in-process for tests (no network, no hub).

make_tiny_tokenizer trains a byte-level BPE on a fixed English corpus; make_tiny_checkpoint saves
a randomly initialised llama / qwen2 / mistral model next to that tokenizer. Both are
deterministic: the same arguments give the same files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from runtime.config import SamplingParams
from runtime.request import GenerationRequest

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0, 1, 2, 3
TINY_VOCAB_SIZE = 256

# Hugging Face module path -> llama.cpp tensor name, written out independently of the converter.
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                     "lm_head": "output"}
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A small model reads the text one token at a "
    "time and guesses what comes next. When the guess is right, the next word costs nothing.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of "
    "Italy, and Madrid is the capital of Spain. Each city has a river, a market and a station.",
    "To bake bread, mix flour, water, salt and yeast. Let the dough rise for two hours, shape "
    "it, and bake it in a hot oven until the crust is brown and the loaf sounds hollow.",
    "The sky is blue because air scatters blue light more than red light. At sunset the light "
    "travels through more air, so the sky turns orange, then red, then dark.",
    "user: What is the capital of France?\nassistant: The capital of France is Paris.\n"
    "user: Tell me a short story.\nassistant: Once upon a time, a cat found a key.\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } - _ + = "
    "* / \\ ' \" # $ % & @ ^ ` ~ < > |",
)


def _initial_alphabet() -> list[str]:
    """Byte-level symbols of tab, newline and printable ASCII (every ASCII text encodes)."""
    text = "\t\n" + "".join(chr(c) for c in range(32, 127))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return sorted(set("".join(piece for piece, _ in byte_level.pre_tokenize_str(text))))


def train_tiny_bpe(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=_initial_alphabet(),
        limit_alphabet=len(_initial_alphabet()),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def make_tiny_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train the tiny BPE, save it (with the chat template) to out_dir and return it."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_bpe(),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _config_class(arch: str) -> Callable[..., PretrainedConfig]:
    classes: dict[str, Callable[..., PretrainedConfig]] = {
        "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
        "mistral": MistralConfig}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    return classes[arch]


def make_tiny_checkpoint(out_dir: Path, *, arch: str = "llama", num_layers: int = 2,
                         hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                         intermediate_size: int = 128, vocab_size: int = TINY_VOCAB_SIZE,
                         max_position_embeddings: int = 512, tie_word_embeddings: bool = False,
                         rope_scaling: dict | None = None, seed: int = 0,
                         head_dim: int | None = None) -> Path:
    """Save a random float32 model, the tiny tokenizer and a generation config to out_dir."""
    if vocab_size < TINY_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {TINY_VOCAB_SIZE} (the tiny tokenizer's size)")
    out_dir = Path(out_dir)
    tokenizer = make_tiny_tokenizer(out_dir)
    config = _config_class(arch)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        initializer_range=0.1,  # large enough that random greedy outputs vary
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"head_dim": head_dim} if head_dim else {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    return out_dir


def _llama_cpp_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py); runtime/gguf_convert.py undoes it.

    weights: [num_heads * head_dim, hidden_size]
    """
    rows = weights.shape[0]
    grouped = weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def _gguf_tensor_name(hf_name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight' (llama.cpp names)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{suffix}"


def make_tiny_gguf(checkpoint_dir: Path, out_path: Path) -> Path:
    """Write a float32 GGUF (with tokenizer metadata) of a tiny llama, qwen2 or qwen3 checkpoint.

    As llama.cpp does, a llama checkpoint gets the "llama" architecture and permuted Q/K rows;
    qwen2 and qwen3 checkpoints keep their rows (and qwen2 its Q/K/V biases, qwen3 its Q/K norms).
    """
    config = AutoConfig.from_pretrained(checkpoint_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint_dir)
    if config.model_type not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"make_tiny_gguf writes llama, qwen2 or qwen3, got {config.model_type!r}")
    permute = config.model_type == "llama"
    writer = gguf.GGUFWriter(out_path, config.model_type)
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_rope_scaling(writer, config, head_dim)
    _add_tokenizer_metadata(writer, tokenizer)
    for name, tensor in load_file(str(checkpoint_dir / "model.safetensors")).items():
        if permute and name.endswith("q_proj.weight"):
            tensor = _llama_cpp_permute(tensor, config.num_attention_heads)
        elif permute and name.endswith("k_proj.weight"):
            tensor = _llama_cpp_permute(tensor, config.num_key_value_heads)
        writer.add_tensor(_gguf_tensor_name(name), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_rope_scaling(writer: gguf.GGUFWriter, config: PretrainedConfig, head_dim: int) -> None:
    """RoPE scaling as llama.cpp's converter writes it: linear and yarn as metadata, Llama 3's as
    a rope_freqs tensor of per-frequency divisors."""
    params = config.rope_parameters or {}
    kind = params.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    elif kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        original = params["original_max_position_embeddings"]
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        divisors = []
        for freq in (1.0 / params["rope_theta"] ** exponents).tolist():
            wavelength = 2 * math.pi / freq
            if wavelength < original / high:
                divisors.append(1.0)
            elif wavelength > original / low:
                divisors.append(factor)
            else:
                smooth = (original / wavelength - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
    elif kind != "default":
        raise ValueError(f"make_tiny_gguf writes no {kind!r} RoPE scaling")


def _add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    """The tokenizer as llama.cpp stores a byte-level BPE ("gpt2") vocabulary."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    normal, control = 1, 3  # llama.cpp token types
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([control if t in SPECIAL_TOKENS else normal for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def random_prompt_requests(lengths: Sequence[int],
                           params: Sequence[SamplingParams] | SamplingParams,
                           seed: int) -> list[GenerationRequest]:
    """Requests "0", "1", ... whose prompts are random ordinary token ids (4..249) of the given
    lengths, drawn one prompt after the other from one seeded generator; `params` per request or
    one for all."""
    g = torch.Generator().manual_seed(seed)
    each = [params] * len(lengths) if isinstance(params, SamplingParams) else list(params)
    return [GenerationRequest(str(i), tuple(torch.randint(4, 250, (n,), generator=g).tolist()),
                              p) for i, (n, p) in enumerate(zip(lengths, each, strict=True))]

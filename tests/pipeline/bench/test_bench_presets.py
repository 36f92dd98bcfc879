"""random:<preset> checkpoints: the real shapes, loadable, lossless with a random drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoTokenizer

from jobs.cli import main
from pipeline.bench import presets
from pipeline.bench.bench_file import read_bench_parquet
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}


def test_presets_have_the_real_shapes() -> None:
    assert presets.preset_names() == ["llama-2-7b", "llama-3-8b", "llama-3.2-1b", "mistral-7b",
                                      "qwen2-0.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b",
                                      "smollm2-135m"]
    llama = presets.PRESETS["llama-3-8b"]
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["num_key_value_heads"],
            llama["vocab_size"]) == (4096, 32, 8, 128256)


def test_byte_tokenizer_round_trips_any_text(tmp_path: Path) -> None:
    presets.make_byte_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "naïve café: 1+1=2\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode()) and max(ids) < 260
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 3


@pytest.mark.parametrize("preset, window", [("smollm2-135m", None), ("qwen2-0.5b", None),
                                            ("qwen3-0.6b", None), ("mistral-7b", 6)])
def test_random_checkpoint_runs_and_a_random_drafter_is_lossless(
        preset: str, window: int | None, tmp_path: Path) -> None:
    shape = TINY if window is None else {**TINY, "sliding_window": window}
    target = presets.make_random_checkpoint(preset, tmp_path / "m", torch.float32, shape=shape)
    config = AutoConfig.from_pretrained(target)
    assert config.model_type == presets.PRESETS[preset]["model_type"]
    assert config.rope_parameters["rope_theta"] == presets.PRESETS[preset]["rope_theta"]
    assert getattr(config, "sliding_window", None) == window
    drafter = presets.make_random_drafter(target, tmp_path / "d", torch.float32)
    request = GenerationRequest("r", (1, 80, 81, 82, 83), SamplingParams(max_tokens=10,
                                                                         ignore_eos=True))
    outputs = []
    for draft in (None, str(drafter)):
        engine = Engine(EngineConfig(model=str(target), drafter=draft, num_speculative_tokens=3,
                                     kv_cache_memory=4 << 20))
        (completion,) = engine.generate([request])
        assert len(completion.token_ids) == 10
        outputs.append(completion)
    assert outputs[0].token_ids == outputs[1].token_ids
    assert outputs[1].num_drafted > 0


def test_bench_on_a_random_preset_says_acceptance_is_meaningless(
        tmp_path: Path, prompts_file: Path, monkeypatch: pytest.MonkeyPatch,
        one_thread_module: None) -> None:
    monkeypatch.setitem(presets.PRESETS, "tiny", {**presets.PRESETS["smollm2-135m"], **TINY})
    out = tmp_path / "report"
    result = CliRunner().invoke(main, [
        "bench", "--model", "random:tiny", "--prompts", str(prompts_file), "--out", str(out),
        "--batch-sizes", "2", "--k", "0,1", "--max-tokens", "4", "--repeats", "1",
        "--baseline", "none", "--num-prompts", "2"])
    assert result.exit_code == 0, result.output
    rows, meta = read_bench_parquet(out / "bench.parquet")
    assert meta["random_weights"] and meta["ignore_eos"]
    assert meta["drafter"] == "random weights (1-layer EAGLE-1)"
    # lookups off unless asked for: a random model's text repeats, and accepted lookups would
    # hide what drafting costs
    assert meta["config"]["draft_ngram"] is False
    assert [(r["variant"], r["k"], r["output_tokens"]) for r in rows] == [
        ("engine", 0, 8), ("engine", 1, 8)]
    report = (out / "report.md").read_text()
    assert "acceptance figures are meaningless" in report
    assert "Prompts are tokenized byte by byte (one token per UTF-8 byte" in report
    assert "## Acceptance (all batch sizes and repeats) (random weights: meaningless)" in report
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # scratch removed


def test_bench_on_a_models_config_alone(tmp_path: Path, prompts_file: Path,
                                        one_thread_module: None) -> None:
    """random:<config.json>: the config's own shape and rope scaling, its token ids replaced
    by the byte tokenizer's, its quantization dropped; a directory holding it works alike."""
    fields = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **TINY,
              "rope_theta": 20000.0, "max_position_embeddings": 512,
              "rope_scaling": {"rope_type": "linear", "factor": 2.0},
              "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
              "bos_token_id": 151643, "eos_token_id": 151645,
              "quantization_config": {"quant_method": "awq", "bits": 4}}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(fields))
    config = presets.preset_config(str(tmp_path / "cfg"))
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 64, 2)
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}
    assert config.layer_types == ["full_attention", "sliding_attention"]
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 3)
    assert getattr(config, "quantization_config", None) is None
    out = tmp_path / "report"
    result = CliRunner().invoke(main, [
        "bench", "--model", f"random:{tmp_path / 'cfg' / 'config.json'}", "--prompts",
        str(prompts_file), "--out", str(out), "--batch-sizes", "2", "--k", "0,2",
        "--max-tokens", "9", "--repeats", "1", "--baseline", "none", "--num-prompts", "2"])
    assert result.exit_code == 0, result.output
    rows, meta = read_bench_parquet(out / "bench.parquet")
    assert meta["random_weights"]
    assert [(r["k"], r["output_tokens"]) for r in rows] == [(0, 18), (2, 18)]
    report = (out / "report.md").read_text()
    assert "acceptance figures are meaningless" in report
    assert "**PASS**: all 2 engine runs produced exactly the same tokens" in report


@pytest.mark.parametrize("text, error", [
    ("{not json", "Expecting property name"),
    ('{"hidden_size": 8}', "not a model config (no model_type)"),
    ('{"model_type": "gpt2", "n_embd": 64}',
     "model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3, mistral)"),
    ('{"model_type": "llama", "vocab_size": 100}',
     "vocab_size 100 is below the 260 tokens of the byte tokenizer")])
def test_a_bad_config_is_a_user_error_naming_the_file(text: str, error: str, tmp_path: Path,
                                                      prompts_file: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    result = CliRunner().invoke(main, ["bench", "--model", f"random:{path}", "--prompts",
                                       str(prompts_file), "--out", str(tmp_path / "r"),
                                       "--k", "0"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: --model random:{path}: {path}: {error}")


def test_unknown_preset_is_a_user_error(tmp_path: Path, prompts_file: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "--model", "random:gpt-9", "--prompts",
                                       str(prompts_file), "--out", str(tmp_path), "--k", "0"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --model random:gpt-9: unknown preset, and no "
                                    "config.json at gpt-9; presets: llama-2-7b, llama-3-8b, ")


GIB = 1 << 30


def test_weights_that_cannot_fit_are_refused_before_anything_is_written() -> None:
    from pipeline.bench.config import BenchConfig
    from pipeline.bench.models import check_memory
    from pipeline.config import JobError

    big = presets.preset_config("llama-3-8b")
    weights = presets.weight_bytes(big, torch.float32)
    assert weights == 8_030_261_248 * 4  # Llama-3-8B's parameter count
    config = BenchConfig("p.parquet", "out", model="random:llama-3-8b")
    with pytest.raises(JobError) as refused:
        check_memory(config, big, torch.float32, torch.device("cpu"), available=22 * GIB)
    # engines: (29.9 GiB of weights + 1.75 x the 1.96 GiB head) x 1.1
    assert str(refused.value) == (
        "--model random:llama-3-8b needs about 66.6 GiB of cpu memory for its float32 weights "
        "(engines: 36.7 GiB, the weights as CPU panels and the head's extra copies; "
        "transformers: 29.9 GiB), more than the 22.0 GiB available; try --baseline none, "
        "--dtype bfloat16 or a smaller model")
    # bfloat16 on a GPU of 80 GiB: one engine copy + transformers' = 29.9 GiB, fits
    check_memory(config, big, torch.bfloat16, torch.device("cuda"), available=80 * GIB)
    no_baseline = BenchConfig("p.parquet", "out", model="random:llama-3-8b", baseline="none")
    # bfloat16 engines alone on the CPU: (15.0 + 1.0 x 0.98) x 1.1 = 17.5 GiB
    check_memory(no_baseline, big, torch.bfloat16, torch.device("cpu"), available=22 * GIB)
    with pytest.raises(JobError, match=r"about 17\.5 GiB of cpu memory for its bfloat16 weights "
                                       r"\(engines: 17\.5 GiB, .*\), more than the 16\.0 GiB "
                                       r"available; try a smaller model$"):
        check_memory(no_baseline, big, torch.bfloat16, torch.device("cpu"), available=16 * GIB)
    check_memory(config, presets.preset_config("smollm2-135m"), torch.float32,
                 torch.device("cpu"), available=22 * GIB)


def test_bench_of_a_preset_too_big_for_this_machine_is_a_user_error(
        tmp_path: Path, prompts_file: Path) -> None:
    """This machine (and CI's) has far less than the ~67 GiB Llama-3-8B's fp32 bench needs."""
    result = CliRunner().invoke(main, ["bench", "--model", "random:llama-3-8b", "--prompts",
                                       str(prompts_file), "--out", str(tmp_path / "r"),
                                       "--device", "cpu", "--k", "0"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --model random:llama-3-8b needs about 66.6 GiB of "
                                    "cpu memory for its float32 weights")
    assert not any((tmp_path / "r").rglob("*.safetensors"))

"""Llama variants whose configs add parameters: attention_bias (q/k/v/o) and mlp_bias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig

from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from runtime.rope import context_length
from runtime.speculative.draft_vocab import DrafterMismatchError
from tests.drafter_fixtures import make_random_drafter
from tests.fixtures import make_tiny_checkpoint, make_tiny_tokenizer


def test_llama_with_attention_and_mlp_biases_matches_transformers(tmp_path: Path) -> None:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attention_bias=True, mlp_bias=True, initializer_range=0.1,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)  # non-zero, so a dropped bias changes the tokens
    reference.save_pretrained(tmp_path)
    make_tiny_tokenizer(tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=4, kv_cache_memory=1 << 20))
    prompt = [5, 9, 33, 12, 80, 7]
    request = GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=12, ignore_eos=True))
    ours = next(iter(engine.generate([request]))).token_ids
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert list(ours) == expected
    assert engine.model.model.layers[0].mlp.down_proj.bias is not None
    assert engine.model.model.layers[0].self_attn.o_proj.bias is not None


def test_qwen3_target_matches_transformers_with_and_without_an_eagle3_drafter(
        tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tests.drafter_fixtures import make_random_drafter  # noqa: PLC0415
    from tests.fixtures import make_tiny_checkpoint  # noqa: PLC0415

    model_dir = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", num_layers=3)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # q_norm / k_norm start at 1: make a dropped norm change the tokens
        g = torch.Generator().manual_seed(2)
        for name, param in reference.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=g))
    reference.save_pretrained(model_dir)
    drafter = make_random_drafter(model_dir, tmp_path / "drafter", num_layers=2, style="eagle3",
                                  draft_vocab_size=100, aux_layer_ids=(0, 1, 2))
    prompts = [[5, 9, 33, 12, 80, 7], [44, 3, 19]]
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for drafter_dir in (None, drafter):
        engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                                     drafter=str(drafter_dir) if drafter_dir else None))
        done = {c.request_id: c for c in engine.generate(
            [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)])}
        assert [list(done[str(i)].token_ids) for i in range(len(prompts))] == expected
        assert engine.model.model.layers[0].self_attn.q_norm.weight.shape == (128,)
        if drafter_dir is not None:
            assert sum(c.num_drafted for c in done.values()) > 0


def test_qwen2_mixing_full_and_sliding_layers_matches_transformers(tmp_path: Path) -> None:
    """Qwen2 with use_sliding_window: layers from max_window_layers on attend over a window,
    the ones below it over everything; two KV cache groups under one block table."""
    import json  # noqa: PLC0415

    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tests.drafter_fixtures import make_random_drafter  # noqa: PLC0415
    from tests.fixtures import make_tiny_checkpoint  # noqa: PLC0415

    model_dir = make_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_layers=3)
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = json.loads((model_dir / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    drafter = make_random_drafter(model_dir, tmp_path / "drafter", num_layers=2,
                                  model_type="qwen2")
    prompts = [[5, 9, 33, 12, 80, 7, 61, 2], [44, 3, 19]]

    def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
        return model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()

    expected = [greedy(reference, p) for p in prompts]
    assert expected != [greedy(full, p) for p in prompts]  # the windows change the tokens
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for backend in ("cpu", "torch"):
        for drafter_dir in (None, drafter):
            engine = Engine(EngineConfig(model=str(model_dir), block_size=4,
                                         kv_cache_memory=1 << 20, attention_backend=backend,
                                         drafter=str(drafter_dir) if drafter_dir else None))
            assert len(engine.kv_cache_config.groups) == 2
            done = {c.request_id: c for c in engine.generate(
                [GenerationRequest(str(i), tuple(p), params) for i, p in enumerate(prompts)])}
            assert [list(done[str(i)].token_ids) for i in range(len(prompts))] == expected
            if drafter_dir is not None:
                assert sum(c.num_drafted for c in done.values()) > 0


def test_a_llama_config_carrying_a_sliding_window_attends_to_everything(tmp_path: Path) -> None:
    """Found by a reviewer: transformers' Llama model ignores `sliding_window` (a relabelled
    Mistral's config carries it), and the engine attended over the window. (transformers'
    `generate` with its cache does not: its cache, built from the config, keeps only the window,
    so its decode steps see the window and its prompt pass everything; without the cache it
    runs the model as defined.)"""
    import json  # noqa: PLC0415

    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tests.fixtures import make_tiny_checkpoint  # noqa: PLC0415

    model_dir = make_tiny_checkpoint(tmp_path / "llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 4
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [5, 9, 33, 12, 80, 7, 61, 2, 17, 40]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0,
                                  use_cache=False)[0, len(prompt):].tolist()
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20))
    assert len(engine.kv_cache_config.groups) == 1
    done = list(engine.generate([GenerationRequest("0", tuple(prompt), SamplingParams(
        max_tokens=12, ignore_eos=True))]))
    assert list(done[0].token_ids) == expected


def test_yarn_over_the_whole_context_extends_it_by_its_factor(tmp_path: Path) -> None:
    """Found by a reviewer: yarn turned on as Qwen2.5's model cards say (original context =
    max_position_embeddings, factor 4) kept the context at max_position_embeddings, where vLLM
    gives original x factor (Qwen3's cards: 40,960 positions over an original 32,768, factor
    4: 131,072); prompts past it were error rows."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tests.fixtures import make_tiny_checkpoint  # noqa: PLC0415

    model_dir = make_tiny_checkpoint(tmp_path / "yarn", arch="qwen2", max_position_embeddings=48,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 48})
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [(11 * i) % 250 + 4 for i in range(100)]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20))
    assert engine.max_model_len == 192
    done = list(engine.generate([GenerationRequest("0", tuple(prompt), SamplingParams(
        max_tokens=8, ignore_eos=True))]))
    assert (done[0].error, list(done[0].token_ids)) == (None, expected)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"]["original_max_position_embeddings"] = 40  # Qwen3's way
    assert context_length(PretrainedConfig(**config)) == 160
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert context_length(PretrainedConfig(**config)) == 96
    # --max-model-len sets it either way
    short = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20,
                                max_model_len=64))
    done = list(short.generate([GenerationRequest("0", tuple(prompt), SamplingParams(
        max_tokens=8, ignore_eos=True))]))
    assert done[0].error == ("prompt has 100 tokens; the model's context is 64 tokens and at "
                             "least one must be left to generate")


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu_pytorch_tanh"},
     "the model's hidden_act 'gelu_pytorch_tanh' is not supported (supported: silu)"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}},
     "rope_type 'longrope' is not supported (its frequencies change with the sequence's length)"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_type 'dynamic' is not supported (its frequencies change with the sequence's length)"),
    # (the types transformers knows, listed after these, depend on its version)
    ({"rope_scaling": {"rope_type": "nonsense", "factor": 2.0}},
     "rope_type 'nonsense' is not a RoPE type (supported: default, linear, llama3, ..."),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor is '2'; expected a number"),
])
def test_a_config_the_engine_would_run_differently_is_refused(
        tmp_path: Path, change: dict, message: str) -> None:
    """Run as SiLU, or with fixed rope frequencies, these models would give other tokens than
    transformers without a word."""
    model_dir = make_tiny_checkpoint(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError) as err:
        Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20))
    if message.endswith("..."):
        assert str(err.value).startswith(message.removesuffix("..."))
    else:
        assert str(err.value) == message


def test_a_window_that_is_not_a_number_is_refused_naming_it(tmp_path: Path) -> None:
    """transformers 5 refuses it when it reads the config, 4.x leaves it to check_layer_config:
    either way a one-line error that names the field."""
    model_dir = make_tiny_checkpoint(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(
        {**config, "model_type": "mistral", "sliding_window": "big"}))
    with pytest.raises(ValueError) as err:
        Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20))
    assert str(err.value) == "the model's sliding_window is 'big'; expected an integer or null" \
        or str(err.value).startswith(f"{model_dir / 'config.json'}: not a valid config "
                                     "(Validation error for field 'sliding_window': ")


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "'s hidden_act 'gelu' is not supported (supported: silu)"),
    ({"rope_scaling": {"rope_type": "nonsense", "factor": 2.0}},
     "'s rope_type 'nonsense' is not a RoPE type (supported: default, linear, llama3, "),  # ...
    ({"rope_theta": "abc"}, "'s rope_theta is 'abc'; expected a number"),
    ({"sliding_window": "big"}, "'s sliding_window is 'big'; expected an integer or null"),
    ({"norm_before_residual": "false"}, ": norm_before_residual is 'false'; expected true or "
                                        "false"),
    ({"draft_vocab_size": "256"}, ": draft_vocab_size is '256'; expected a positive integer"),
])
def test_a_drafter_config_the_layers_would_misread_is_refused(
        tiny_model_dir: Path, tmp_path: Path, change: dict, message: str) -> None:
    """Fields of another type than a public config gives them would raise deep in the build
    (a KeyError, a TypeError), or be misread (the string "false" is true): refused, naming the
    drafter's config.json and the field."""
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "bad", num_layers=1)
    config = json.loads((drafter / "config.json").read_text())
    config.pop("rope_parameters", None)  # (public EAGLE configs give rope_theta at the top)
    (drafter / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DrafterMismatchError) as err:
        Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=1 << 20,
                            drafter=str(drafter)))
    assert str(err.value).startswith(f"drafter {drafter / 'config.json'}{message}")


def test_a_tied_config_with_a_head_of_other_values_uses_that_head_as_transformers_does(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Found by QA: config.json ties the head, the weights hold one of other values, and
    transformers keeps that head, untied (with a warning); the engine tied it again, silently,
    and gave other tokens. A stored head equal to the embedding stays tied."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from runtime.speculative.train_init import load_target  # noqa: PLC0415

    prompt = [5, 9, 33, 12, 80, 7]
    for differs in (True, False):
        model_dir = make_tiny_checkpoint(tmp_path / str(differs), tie_word_embeddings=True)
        weights = load_file(model_dir / "model.safetensors")
        embedding = weights["model.embed_tokens.weight"]
        weights["lm_head.weight"] = (torch.randn(embedding.shape, generator=torch.Generator(
            ).manual_seed(1)) * 0.1 if differs else embedding.clone())
        save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        assert (reference.lm_head.weight is reference.model.embed_tokens.weight) is not differs
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        capfd.readouterr()
        engine = Engine(EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=1 << 20))
        done = list(engine.generate([GenerationRequest("0", tuple(prompt), SamplingParams(
            max_tokens=12, ignore_eos=True))]))
        assert list(done[0].token_ids) == expected
        note = (f"note: {model_dir} ties the LM head to the embedding (tie_word_embeddings), but "
                "its weights hold a head of other values: that head is used, untied, as "
                "transformers does; set tie_word_embeddings to false to say so")
        assert (note in " ".join(capfd.readouterr().err.split())) is differs
        # train-drafter's target (built without the engine) reads the same head (found by
        # review: it trained against the embedding)
        target = load_target(model_dir, reference.config)
        assert torch.equal(target.lm_head.weight, weights["lm_head.weight"])
        assert (target.lm_head.weight is target.model.embed_tokens.weight) is not differs

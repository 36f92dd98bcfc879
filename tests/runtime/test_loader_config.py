"""The loader's cache directory and model paths, a checkpoint's EOS ids, tokenizer and chat
template, and config files it refuses by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.loader import (
    cache_dir,
    eos_token_ids,
    load_model_config,
    load_tokenizer,
    resolve_model,
)


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("EAGLEBATCH_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "eaglebatch"


def test_resolve_model_returns_checkpoint_directory(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir


@pytest.mark.parametrize("kind", ["missing", "empty-dir", "not-gguf"])
def test_resolve_model_rejects_other_inputs(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model"
    if kind == "empty-dir":
        path.mkdir()
    elif kind == "not-gguf":
        path.write_text("not a model")
    with pytest.raises(ValueError, match="built-in name.*gguf.*config.json") as err:
        resolve_model(str(path))
    assert repr(str(path)) in str(err.value)


def test_eos_token_ids_from_the_generation_config_else_the_config(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    assert eos_token_ids(tiny_model_dir, tokenizer) == frozenset({2})
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [9, 11]}))
    # transformers' generate stops on the generation config's ids alone; the tokenizer's EOS
    # (2) is added, as vLLM adds it
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    assert eos_token_ids(model_dir, tokenizer) == frozenset({2, 7})
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert eos_token_ids(model_dir, tokenizer) == frozenset({2, 9, 11})
    (model_dir / "generation_config.json").unlink()
    assert eos_token_ids(model_dir, tokenizer) == frozenset({2, 9, 11})
    # found by QA: a string "12" was read as the ids 1 and 2, [null] gave a TypeError, a file
    # that is not JSON a message naming no file
    where = model_dir / "generation_config.json"
    for text, why in (('{"eos_token_id": "12"}', 'eos_token_id is "12"; expected a token id or '
                                                 'a list of token ids'),
                      ('{"eos_token_id": [null]}', "eos_token_id is [null]; expected a token id "
                                                   "or a list of token ids"),
                      ("{eos", "not JSON (Expecting property name enclosed in double quotes: "
                               "line 1 column 2 (char 1))"),
                      ("[2]", "not a JSON object")):
        where.write_text(text)
        with pytest.raises(ValueError) as err:
            eos_token_ids(model_dir, tokenizer)
        assert str(err.value) == f"{where}: {why}"


def test_tokenizer_round_trip_and_chat_template(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    assert (len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
            tokenizer.pad_token_id, tokenizer.unk_token_id) == (256, 1, 2, 3, 0)
    text = "The capital of France is Paris.\nuser: {Hi} 42!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<s>system: Be brief.</s>\nuser: Hi</s>\nassistant:"
    ids = tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <s> once, </s> after each message
    config = load_model_config(tiny_model_dir)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 2, 256)


def test_a_tokenizer_file_that_is_not_json_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    (model_dir / "tokenizer.json").write_text("garbage")
    with pytest.raises(ValueError) as err:
        load_tokenizer(model_dir)
    assert str(err.value) == (f"{model_dir / 'tokenizer.json'}: not JSON (Expecting value: line "
                              "1 column 1 (char 0))")


def test_a_context_that_is_not_a_positive_integer_is_refused(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    """max_position_embeddings 0 made every row an error row ('a prompt may have at most
    -1 tokens'), found by QA."""
    from runtime.config import EngineConfig  # noqa: PLC0415
    from runtime.engine import Engine  # noqa: PLC0415

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 0}))
    with pytest.raises(ValueError) as err:
        Engine(EngineConfig(model=str(model_dir)))
    assert str(err.value) == ("the model's max_position_embeddings is 0; expected a positive "
                              "integer (the context a request may grow to)")

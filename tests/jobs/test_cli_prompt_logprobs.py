"""`eaglebatch generate --prompt-logprobs`: a prompt_logprobs column to score text, through the
real CLI and engine on the tiny checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from click.testing import CliRunner, Result
from transformers import AutoTokenizer

from jobs.cli import main
from tests.drafter_fixtures import make_random_drafter
from tests.pipeline.helpers import read_parts, write_parquet

PROMPTS = ["Paris is the capital of France, and Berlin", "The quick brown fox", None, "a",
           "The quick brown fox jumps over the lazy dog"]


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB", *args])


def test_prompt_logprobs_score_the_text_as_transformers_the_same_in_any_run(
        tmp_path: Path, tiny_model_dir: Path, tiny_hf_model: Any) -> None:
    """One value per prompt token, the first null, each within float32 rounding of
    transformers' log-softmax at the next token (--no-chat-template: the text's tokens alone);
    the same with a drafter, with small prompt chunks and with a chat template that shares its
    prefix between rows; an error row gets null."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter")
    runs = {}
    for name, args in (("plain", ()), ("drafter", ("--drafter", str(drafter), "--k", "3")),
                       ("chunks", ("--max-num-batched-tokens", "5"))):
        result = _generate(tiny_model_dir, path, tmp_path / name, "--prompt-logprobs",
                           "--max-tokens", "10", "--no-chat-template", *args)
        assert result.exit_code == 0, result.output
        runs[name] = read_parts(tmp_path / name)
    table = runs["plain"]
    assert table.schema.names[-2:] == ["error", "prompt_logprobs"]
    assert table.schema.field("prompt_logprobs").type == pa.list_(pa.float32())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for row in table.to_pylist():
        if row["prompt"] is None:
            assert row["finish_reason"] == "error" and row["prompt_logprobs"] is None
            continue
        _check(tiny_hf_model, tokenizer(row["prompt"])["input_ids"], row)
    for name in ("drafter", "chunks"):
        assert runs[name].drop(["num_drafted", "num_accepted"]).equals(
            table.drop(["num_drafted", "num_accepted"])), name
    assert sum(runs["drafter"].column("num_drafted").to_pylist()) > 0
    # the chat template's tokens before the prompt, which the prefix cache would serve, are
    # scored too
    assert _generate(tiny_model_dir, path, tmp_path / "chat", "--prompt-logprobs",
                     "--max-tokens", "1", "--max-num-seqs", "1").exit_code == 0
    for row in read_parts(tmp_path / "chat").to_pylist():
        if row["prompt"] is not None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                 tokenize=False, add_generation_prompt=True)
            _check(tiny_hf_model, tokenizer(text, add_special_tokens=False)["input_ids"], row)


def _check(model: Any, ids: list[int], row: dict[str, Any]) -> None:
    """The row's prompt_logprobs are transformers' log-softmax at each next token of `ids`."""
    logprobs = row["prompt_logprobs"]
    assert len(logprobs) == row["prompt_tokens"] == len(ids) and logprobs[0] is None
    if len(ids) == 1:  # "a": nothing to score
        assert row["prompt"] == "a"
        return
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], dim=-1).gather(
        1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert (torch.tensor(logprobs[1:]) - expected).abs().max().item() < 1e-4

def test_prompt_logprobs_resume_and_a_clashing_column(tmp_path: Path,
                                                      tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:2]})
    assert _generate(tiny_model_dir, path, tmp_path / "out", "--prompt-logprobs").exit_code == 0
    result = _generate(tiny_model_dir, path, tmp_path / "out")
    assert result.exit_code == 2
    assert ("holds the outputs of a different job (prompt_logprobs: True -> not given)"
            in result.stderr)
    clash = tmp_path / "clash.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS[:1], "prompt_logprobs": [0.5]}), clash)
    result = _generate(tiny_model_dir, clash, tmp_path / "out2", "--prompt-logprobs")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {clash}: input column 'prompt_logprobs' has the "
                                    "name of an output column")
    assert _generate(tiny_model_dir, clash, tmp_path / "out3").exit_code == 0

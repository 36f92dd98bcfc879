"""`eaglebatch generate --stop-token-ids / --ignore-eos / --include-stop-str-in-output`, and the
stop_token_ids column, through the real CLI and engine on the tiny checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
from click.testing import CliRunner, Result

from jobs.cli import main
from tests.pipeline.helpers import read_parts, write_parquet

PROMPTS = ["Paris is the capital of", "The quick brown fox", "Numbers: 0 1 2 3"]


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB",
                                     "--max-tokens", "12", *args])


def _rows(out: Path) -> list[dict[str, Any]]:
    return read_parts(out).to_pylist()


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:end]


def test_stop_token_ids_option_and_column(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Rows end at the first of the stop token ids (kept as the last token); a stop_token_ids
    column overrides the option row by row (null keeps it, [] means none); an id outside the
    vocabulary is refused as an option and fails its row as a value."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    assert _generate(tiny_model_dir, path, tmp_path / "plain", "--ignore-eos").exit_code == 0
    plain = [r["completion_token_ids"] for r in _rows(tmp_path / "plain")]
    stops = {plain[0][2], plain[1][4]}
    result = _generate(tiny_model_dir, path, tmp_path / "stops", "--ignore-eos",
                       "--stop-token-ids", ",".join(map(str, sorted(stops))))
    assert result.exit_code == 0, result.output
    rows = _rows(tmp_path / "stops")
    assert [r["completion_token_ids"] for r in rows] == [_cut(p, stops) for p in plain]
    assert [r["finish_reason"] for r in rows[:2]] == ["stop", "stop"]
    assert len(rows[0]["completion_token_ids"]) <= 3

    per_row = write_parquet(tmp_path / "per-row.parquet", {
        "prompt": PROMPTS + ["Paris is the capital of"],
        "stop_token_ids": pa.array([None, [], [plain[2][1], None], [-1]], pa.list_(pa.int64()))})
    result = _generate(tiny_model_dir, per_row, tmp_path / "per-row", "--ignore-eos",
                       "--stop-token-ids", str(plain[0][2]))
    assert result.exit_code == 0, result.output
    rows = _rows(tmp_path / "per-row")
    assert [r["completion_token_ids"] for r in rows[:3]] == [
        _cut(plain[0], {plain[0][2]}), plain[1], _cut(plain[2], {plain[2][1]})]
    assert rows[3]["finish_reason"] == "error"
    assert rows[3]["error"] == "bad per-row sampling option: stop token ids must be >= 0, got -1"

    outside = write_parquet(tmp_path / "outside.parquet", {"prompt": PROMPTS[:2],
                                                           "stop_token_ids": [[256], None]})
    assert _generate(tiny_model_dir, outside, tmp_path / "outside").exit_code == 0
    rows = _rows(tmp_path / "outside")
    assert rows[0]["error"] == "stop token id 256 is outside the model's vocabulary (ids 0 to 255)"
    assert rows[1]["finish_reason"] in ("stop", "length")
    result = _generate(tiny_model_dir, path, tmp_path / "bad", "--stop-token-ids", "5,256")
    assert result.exit_code == 2
    assert "error: --stop-token-ids: 256 is outside the vocabulary of" in result.stderr
    for bad, said in (("5,x", "'5,x' is not a comma-separated list of token ids (digits 0-9): "
                              "'x'"),
                      ("-3", "(digits 0-9): '-3'"), ("5,,6", "(digits 0-9): an empty entry"),
                      ("\u0663", "(digits 0-9): '\u0663'")):
        result = _generate(tiny_model_dir, path, tmp_path / "bad", "--stop-token-ids", bad)
        assert result.exit_code == 2 and said in result.output, result.output
    # the same set in another order, repeated, spaced: the same job, which resumes
    assert _generate(tiny_model_dir, path, tmp_path / "stops", "--ignore-eos",
                     "--stop-token-ids", " , ".join(map(str, sorted(stops, reverse=True) * 2))
                     ).exit_code == 0
    strings = write_parquet(tmp_path / "strings.parquet", {"prompt": PROMPTS[:1],
                                                           "stop_token_ids": [["7"]]})
    result = _generate(tiny_model_dir, strings, tmp_path / "strings")
    assert result.exit_code == 2
    assert ("column 'stop_token_ids' overrides the stop_token_ids option per row and must be "
            "list<integer>, but it is list<element: string>") in result.stderr


def test_ignore_eos_runs_to_max_tokens_and_stop_strings_kept_on_request(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A model whose EOS its greedy text makes third: rows end there, and with --ignore-eos
    run to --max-tokens. --include-stop-str-in-output keeps the stop string at the end of the
    text. Each option is recorded: a resume without it is refused, and the report names it."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    assert _generate(tiny_model_dir, path, tmp_path / "plain", "--ignore-eos").exit_code == 0
    plain = _rows(tmp_path / "plain")
    model = tmp_path / "early-eos"
    shutil.copytree(tiny_model_dir, model)
    eos = plain[0]["completion_token_ids"][2]
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": eos}))
    assert _generate(model, path, tmp_path / "eos").exit_code == 0
    ended = _rows(tmp_path / "eos")
    assert ended[0]["completion_token_ids"] == plain[0]["completion_token_ids"][:3]
    assert ended[0]["finish_reason"] == "stop"
    assert _generate(model, path, tmp_path / "ignored", "--ignore-eos").exit_code == 0
    ignored = _rows(tmp_path / "ignored")
    assert [r["completion_token_ids"] for r in ignored] == [r["completion_token_ids"]
                                                            for r in plain]
    assert {r["completion_tokens"] for r in ignored} == {12}

    text = plain[1]["completion"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip())
    at = text.index(stop)
    for flag, expected in (((), text[:at]), (("--include-stop-str-in-output",),
                                            text[:at + len(stop)])):
        out = tmp_path / f"stop{len(flag)}"
        result = _generate(tiny_model_dir, path, out, "--ignore-eos", "--stop", stop, *flag)
        assert result.exit_code == 0, result.output
        row = _rows(out)[1]
        assert row["completion"] == expected and row["finish_reason"] == "stop"
    result = _generate(tiny_model_dir, path, tmp_path / "stop1", "--ignore-eos", "--stop", stop)
    assert result.exit_code == 2
    assert ("holds the outputs of a different job (sampling.include_stop_str_in_output: True -> "
            "not given)") in result.stderr
    assert CliRunner().invoke(main, ["report", str(tmp_path / "stop1")]).exit_code == 0
    report = (tmp_path / "stop1" / "report.md").read_text()
    assert (f"- max_tokens 12, temperature 0.0, ignore_eos True, include_stop_str_in_output "
            f"True, stop {stop!r}, n 1") in report


def test_min_tokens_holds_a_stop_string_back(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A stop string whose first occurrence ends inside the first --min-tokens tokens' text
    ends the row at its next one (as vLLM's min_tokens), and the text is cut there."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    assert _generate(tiny_model_dir, path, tmp_path / "plain", "--ignore-eos",
                     "--max-tokens", "24").exit_code == 0
    cases = []
    for row in _rows(tmp_path / "plain"):
        tokens = row["completion_token_ids"]
        texts = [tokenizer.decode(tokens[:k], skip_special_tokens=True) for k in range(25)]
        text = texts[-1]
        for stop in sorted({c for c in text if c.strip()}):
            first = text.find(stop)
            if text.find(stop, first + 1) < 0:
                continue
            m = next(k for k in range(25) if len(texts[k]) > first)  # its first ends in k
            end = next(k for k in range(m + 1, 25) if texts[k].find(stop, len(texts[m])) >= 0)
            cases.append((row["prompt"], stop, m, tokens[:end],
                          texts[end][:texts[end].index(stop, len(texts[m]))]))
            break
    assert cases
    for prompt, stop, m, tokens, text in cases:
        single = write_parquet(tmp_path / "one.parquet", {"prompt": [prompt]})
        out = tmp_path / f"held-{len(tokens)}-{m}"
        result = _generate(tiny_model_dir, single, out, "--ignore-eos", "--max-tokens", "24",
                           "--stop", stop, "--min-tokens", str(m))
        assert result.exit_code == 0, result.output
        row = _rows(out)[0]
        assert (row["completion_token_ids"], row["completion"]) == (tokens, text)
        assert row["finish_reason"] == "stop" and stop in text


def test_a_stop_string_that_is_a_special_tokens_text_is_noted(tmp_path: Path,
                                                               tiny_model_dir: Path) -> None:
    """Special tokens are left out of the text, so such a stop string never matches: the job
    says so and names the token's id for --stop-token-ids."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:1]})
    result = _generate(tiny_model_dir, path, tmp_path / "out", "--stop", "x", "--stop", eos)
    assert result.exit_code == 0, result.output
    assert (f"note: --stop {eos!r} is the text of a special token, which completions leave out, "
            f"so it never matches; to stop at it, use --stop-token-ids "
            f"{tokenizer.eos_token_id}\n") in result.stderr
    assert "special token" not in _generate(tiny_model_dir, path, tmp_path / "plain",
                                            "--stop", "x").stderr

"""`eaglebatch generate`'s user errors: bad inputs, options and output directories exit 2 with
one line; every option has help."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from jobs.cli import main
from tests.pipeline.helpers import not_utf8, write_parquet


@pytest.mark.parametrize(("setup", "args", "message"), [
    ("missing_column", (), "{input}: no column 'prompt' (columns: id, text); choose the column "
                           "with --prompt-column"),
    ("duplicate_ids", (), "duplicate id 'x' in column 'id': {input} row 0 and {input} row 2; "
                          "ids must be unique"),
    ("corrupt", (), "{input}: not a readable Parquet file ("),
    ("name_not_utf8", (), "{input}: not a readable Parquet file ("),
    ("ok", ("--messages-column", "msgs", "--no-chat-template"),
     "--messages-column needs the chat template; drop --no-chat-template"),
    ("parts_without_manifest", (), "{out} holds part-00000.parquet but no manifest.json"),
    ("ok", ("--model", "{tmp}/no-such-model"), "cannot load --model {tmp}/no-such-model: "),
    ("not_utf8_id", (), "{input}: id column 'id' is not valid UTF-8 at row 1 (invalid start "
                        "byte at byte 0)"),
    ("ok", ("--id-column", "error"), "--id-column 'error': {input} has no such column, so ids "
                                     "would be written to a new one, but that is the name of an "
                                     "output column"),
    ("out_is_a_file", (), "OUTPUT_DIR {out} is a file, not a directory"),
])
def test_user_errors_exit_2_with_one_line(tmp_path: Path, setup: str, args: tuple[str, ...],
                                          message: str) -> None:
    path = tmp_path / "in.parquet"
    out = tmp_path / "out"
    if setup == "missing_column":
        write_parquet(path, {"id": ["a"], "text": ["hi"]})
    elif setup == "duplicate_ids":
        write_parquet(path, {"id": ["x", "y", "x"], "prompt": ["a", "b", "c"]})
    elif setup == "corrupt":
        path.write_bytes(b"PAR1 but not really")
    elif setup == "name_not_utf8":  # a column name in the footer that is not UTF-8 (a traceback)
        write_parquet(path, {"id": ["a"], "prompt": ["hi"], "note": ["x"]})
        data = path.read_bytes()
        footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        path.write_bytes(data[:footer] + data[footer:].replace(b"note", b"\xffote"))
    elif setup == "not_utf8_id":
        write_parquet(path, {"id": not_utf8(["a", "bb", "c"], 1), "prompt": ["x", "y", "z"]})
    else:
        write_parquet(path, {"id": ["a"], "prompt": ["hi"]})
    if setup == "parts_without_manifest":
        out.mkdir()
        (out / "part-00000.parquet").write_bytes(b"x")
    if setup == "out_is_a_file":
        out.write_bytes(b"")
    fmt = {"input": path, "out": out, "tmp": tmp_path}
    argv = ["generate", str(path), str(out), "--model", str(tmp_path / "no-such-model")]
    if "--model" in args:
        argv = ["generate", str(path), str(out)]
    result = CliRunner().invoke(main, argv + [a.format(**fmt) for a in args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: " + message.format(**fmt))
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_bad_option_values_exit_2() -> None:
    result = CliRunner().invoke(main, ["generate", "in", "out", "--kv-cache-memory", "lots"])
    assert result.exit_code == 2 and "cannot read memory size 'lots'" in result.output
    result = CliRunner().invoke(main, ["generate", "in", "out", "--top-p", "0"])
    assert result.exit_code == 2
    result = CliRunner().invoke(main, ["generate", "in", "out", "--stop", "\n", "--stop", ""])
    assert result.exit_code == 2
    assert ("Invalid value for '--stop': an empty stop string would end every completion at its "
            "first token") in result.output


def test_every_option_has_help() -> None:
    for param in main.commands["generate"].params:
        if isinstance(param, __import__("click").Option):
            assert param.help and len(param.help) > 20, param.name

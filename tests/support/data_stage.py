"""Helpers for the data-stage jobscripts' tests: entry points run in this process, and the
inputs they read (a FineWeb-layout Parquet file, a corpus the raw gate must stop)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

VOCAB = 1200  # the demo tokenizer's vocabulary size


def parquet_bytes(rows: list[tuple[str | None, str]]) -> bytes:
    """A FineWeb-layout Parquet file (``text``, ``id``) holding ``rows``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [r[0] for r in rows], "id": [r[1] for r in rows]}), sink)
    return sink.getvalue().to_pybytes()


def run_main(main, argv: list[str], result: Path) -> tuple[int, dict, str]:
    """Run an entry point in-process; return (exit code, result JSON, captured stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--result", str(result)])
    return code, json.loads(result.read_text()), out.getvalue()


def ok(main, argv: list[str], result: Path) -> dict:
    """Run an entry point that must succeed; return its result JSON."""
    code, payload, _ = run_main(main, argv, result)
    assert code == 0, payload
    return payload


def tokenize_argv(src, tokenizer_dir, out, *extra: str) -> list[str]:
    return [
        "--input",
        str(src),
        "--tokenizer",
        str(tokenizer_dir),
        "--output-dir",
        str(out),
        *extra,
    ]


def bad_corpus(path: Path) -> None:
    """A JSONL corpus with one of each fault the raw gate names (line numbers matter)."""
    lines = [
        json.dumps({"id": "1", "text": "A perfectly normal document."}).encode(),
        json.dumps({"id": "2", "text": None}).encode(),  # null text
        json.dumps({"id": "3", "text": ""}).encode(),  # empty
        b'{"id": "4", "text": "caf\xe9 latin-1 bytes"}',  # invalid UTF-8
        json.dumps({"id": "5", "text": "Same words twice."}).encode(),
        json.dumps({"id": "6", "text": "Same words twice."}).encode(),  # duplicate text
        b'{"id": "7", "text": "unterminated',  # malformed JSON
        json.dumps({"id": "1", "text": "Another id one."}).encode(),  # duplicate id
        json.dumps(
            {"id": "9", "text": "mojibake \ufffd\ufffd\ufffd and \x00\x01 controls"}
        ).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")

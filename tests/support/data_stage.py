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


def cluster_campaign(name: str, remote_root: str, data: dict, *, time_limit: str = "10",
                     environment: dict | None = None, max_segments: int = 1) -> dict:
    """A small campaign for the data stage's cluster tests (tests/jobscripts/*_on_cluster.py):
    CPU jobs on the local cluster's debug partition, a tiny reference model, no tracking, no
    retries; ``data`` is the campaign's data section."""
    from tests.support import cluster

    return {
        "name": name,
        "cluster": {"ssh_conn_id": cluster.CONN_ID, "partition": "debug", "gpus_per_node": 0,
                    "cpus_per_task": 1, "mem": "2G", "time_limit": time_limit,
                    "remote_root": remote_root, "environment": environment or {}},
        "data": data,
        "model": {"reference": {"hidden_size": 64, "num_layers": 1, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "ffn_hidden_size": 176}},
        "training": {"train_iters": 10, "global_batch_size": 8, "micro_batch_size": 4,
                     "seq_length": 128, "lr": 1.0e-3},
        "checkpoint": {"save_interval": 5},
        "tracking": {"enabled": False},
        "retries": {part: {"retries": 0, "retry_delay": 5} for part in ("data", "train",
                                                                         "export")},
        "segments": {"max_per_run": max_segments, "startup_estimate_min": 1,
                     "save_estimate_s": 5, "margin_min": 2},
    }

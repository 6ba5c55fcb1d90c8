"""Session fixtures for the data-stage jobscripts: one small demo corpus run through each step.

Everything runs in this process (``main(argv)``), so megatron-core, transformers and
great-expectations are imported once per session. No network, no /work/shared. S3 is a real
S3 API: moto's server, one per session, started only by tests that ask for it.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

DEMO_BYTES = 250_000
VOCAB = 1200


def parquet_bytes(rows: list[tuple[str | None, str]]) -> bytes:
    """A FineWeb-layout Parquet file (``text``, ``id``) holding ``rows``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [r[0] for r in rows], "id": [r[1] for r in rows]}), sink)
    return sink.getvalue().to_pybytes()


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    from tests.support.mlflow_server import MotoS3

    with MotoS3(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


def run_main(main, argv: list[str], result: Path) -> tuple[int, dict, str]:
    """Run an entry point in-process; return (exit code, result JSON, captured stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--result", str(result)])
    return code, json.loads(result.read_text()), out.getvalue()


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-stage")


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


@pytest.fixture(scope="session")
def demo_parquet(work) -> dict:
    from jobscripts.demo_corpus import main

    argv = ["--output-dir", str(work / "parquet"), "--target-bytes", str(DEMO_BYTES)]
    return ok(main, argv, work / "demo.json")


@pytest.fixture(scope="session")
def ingested(work, demo_parquet) -> dict:
    from jobscripts.ingest import main

    argv = ["--input", demo_parquet["output_dir"], "--output-dir", str(work / "ingest")]
    return ok(main, [*argv, "--workers", "1"], work / "ingest.json")


@pytest.fixture(scope="session")
def tokenizer(work, ingested) -> dict:
    from jobscripts.train_tokenizer import main

    argv = ["--input", str(work / "ingest" / "jsonl"), "--output-dir", str(work / "tokenizer")]
    return ok(main, [*argv, "--vocab-size", str(VOCAB)], work / "tokenizer.json")


@pytest.fixture(scope="session")
def tokenized(work, ingested, tokenizer) -> dict:
    from jobscripts.tokenize_megatron import main

    argv = tokenize_argv(work / "ingest" / "jsonl", tokenizer["tokenizer_dir"], work / "tokens")
    return ok(main, [*argv, "--workers", "2"], work / "tokenize.json")


@pytest.fixture(scope="session")
def megatron_tokenizer(tokenizer):
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=tokenizer["tokenizer_dir"], metadata_path={"library": "huggingface"}
    )

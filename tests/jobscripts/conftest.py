"""Session fixtures for the data-stage jobscripts: one small demo corpus run through each step.

Everything runs in this process (``main(argv)``), so megatron-core, transformers and
great-expectations are imported once per session. No network, no /work/shared.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

DEMO_BYTES = 250_000
VOCAB = 1200


def run_main(main, argv: list[str], result: Path) -> tuple[int, dict, str]:
    """Run an entry point in-process; return (exit code, result JSON, captured stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--result", str(result)])
    return code, json.loads(result.read_text()), out.getvalue()


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-stage")


@pytest.fixture(scope="session")
def demo_parquet(work) -> dict:
    from jobscripts.demo_corpus import main

    code, result, _ = run_main(
        main,
        ["--output-dir", str(work / "parquet"), "--target-bytes", str(DEMO_BYTES)],
        work / "demo.json",
    )
    assert code == 0, result
    return result


@pytest.fixture(scope="session")
def ingested(work, demo_parquet) -> dict:
    from jobscripts.ingest import main

    code, result, _ = run_main(
        main,
        [
            "--input",
            demo_parquet["output_dir"],
            "--output-dir",
            str(work / "ingest"),
            "--workers",
            "1",
        ],
        work / "ingest.json",
    )
    assert code == 0, result
    return result


@pytest.fixture(scope="session")
def tokenizer(work, ingested) -> dict:
    from jobscripts.train_tokenizer import main

    code, result, _ = run_main(
        main,
        [
            "--input",
            str(work / "ingest" / "jsonl"),
            "--output-dir",
            str(work / "tokenizer"),
            "--vocab-size",
            str(VOCAB),
        ],
        work / "tokenizer.json",
    )
    assert code == 0, result
    return result


@pytest.fixture(scope="session")
def tokenized(work, ingested, tokenizer) -> dict:
    from jobscripts.tokenize_megatron import main

    code, result, _ = run_main(
        main,
        [
            "--input",
            str(work / "ingest" / "jsonl"),
            "--tokenizer",
            tokenizer["tokenizer_dir"],
            "--output-dir",
            str(work / "tokens"),
            "--workers",
            "2",
        ],
        work / "tokenize.json",
    )
    assert code == 0, result
    return result


@pytest.fixture(scope="session")
def megatron_tokenizer(tokenizer):
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=tokenizer["tokenizer_dir"], metadata_path={"library": "huggingface"}
    )

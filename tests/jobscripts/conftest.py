"""Session fixtures for the data-stage jobscripts: one small demo corpus run through each step.

Everything runs in this process (``main(argv)``), so megatron-core, transformers and
great-expectations are imported once per session. No network, no /work/shared. S3 is a real
S3 API: moto's server, one per session, started only by tests that ask for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.data_stage import VOCAB, ok, tokenize_argv

DEMO_BYTES = 250_000


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    from tests.support.cluster import address_for_jobs
    from tests.support.mlflow_server import MotoS3

    # The data stage's jobs read it from the cluster's nodes, whose 127.0.0.1 is their own.
    with MotoS3(tmp_path_factory.mktemp("moto") / "moto.log", host=address_for_jobs()) as server:
        yield server


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-stage")


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

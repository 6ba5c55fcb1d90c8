"""Fixtures for export, evaluation, registry and comparison: one tiny trained model per session.

The model is the reference trainer's (run in-process, as tests/trainer does) on the synthetic
bigram-chain data, with a word-level tokenizer whose words ``t0 .. t255`` are the chain's ids,
so held-out *text* drawn from the same chain is something the model can learn.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.export_eval.cluster_site import cluster_export, evaluations, site  # noqa: F401 (fixtures)
from tests.support.export import TRAIN_ITERS, run_export
from tests.trainer.synthetic_data import EOD_ID, VOCAB_SIZE, base_config, write_dataset

# vLLM's CPU attention takes head sizes 32, 64, 80, ... only: hidden 64 over 2 heads (and one
# KV group) is 32, so the same export is evaluated by vLLM and transformers.
VLLM_HEADS = {"num_attention_heads": 2, "num_query_groups": 1}


def chain_successors(seed: int = 0) -> np.ndarray:
    # write_dataset's first draw from default_rng(seed): the chain the training data follows.
    return np.random.default_rng(seed).integers(1, VOCAB_SIZE, size=(VOCAB_SIZE, 2))


def heldout_texts(documents: int, seed: int = 99) -> list[str]:
    """Documents from the training chain (not the training documents), as tokenizer words."""
    rng, successors = np.random.default_rng(seed), chain_successors()
    texts = []
    for _ in range(documents):
        ids = [int(rng.integers(1, VOCAB_SIZE))]
        for choice in rng.integers(0, 2, size=int(rng.integers(20, 90))):
            ids.append(int(successors[ids[-1], choice]))
        texts.append(" ".join(f"t{i}" for i in ids))
    return texts


def write_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"t{EOD_ID}")
    fast.save_pretrained(directory)
    return directory


@dataclass
class Trained:
    root: Path  # checkpoint root (iter_* + tracker)
    tokenizer: Path
    heldout: Path  # JSONL with a "text" field
    seq_length: int
    untrained: Path  # HF directory of the same model before any step
    dataset: Path  # the Megatron prefix it trained on
    split: str  # ... split like this: the valid part was never trained on
    config: dict  # the trainer's run config


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Trained:
    return train_model(tmp_path_factory.mktemp("export_eval"))


def train_model(base: Path) -> Trained:
    """The tiny model, trained in ``base`` (also used by tests/bench/bench_evaluate.py)."""
    from jobscripts.reference_trainer import main
    from jobscripts.trainer_config import from_dict
    from jobscripts.trainer_state import build_model

    tokenizer = write_tokenizer(base / "tokenizer")
    prefix = write_dataset(base / "synthetic_text_document")
    config = base_config(prefix, base / "ckpt", tokenizer_model=str(tokenizer), vocab_size=None,
                         eod_id=None, train_iters=TRAIN_ITERS, save_interval=TRAIN_ITERS // 2,
                         eval_interval=None, **VLLM_HEADS)
    (base / "run.json").write_text(json.dumps(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--config", str(base / "run.json")])
    assert rc == 0, out.getvalue()[-3000:]

    untrained = base / "untrained"
    model, _ = build_model(from_dict(config), VOCAB_SIZE, EOD_ID)  # the seeded initial weights
    model.save_pretrained(untrained)
    for item in tokenizer.iterdir():
        shutil.copy2(item, untrained / item.name)

    heldout = base / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": t}) + "\n" for t in heldout_texts(12)))
    return Trained(base / "ckpt", tokenizer, heldout, config["seq_length"], untrained, prefix,
                   config["split"], config)


@pytest.fixture(scope="session")
def exported(trained, tmp_path_factory) -> tuple[Path, dict]:
    output = tmp_path_factory.mktemp("exports") / "hf"
    rc, result = run_export(output, "--checkpoint-root", str(trained.root))
    assert rc == 0, result
    return output, result


# --- the session's MLflow server with its artifacts on moto S3 (tests/conftest.py), as in
# production: clients write artifacts to S3 with the connection's keys -----------------------
@pytest.fixture(scope="session")
def mlflow_uri(mlflow_server) -> str:
    return mlflow_server.url


@pytest.fixture
def mlflow_client(mlflow_server):
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings

    return make_client(tracking_settings(mlflow_server.connection()))

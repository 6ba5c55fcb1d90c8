"""A small reference-trainer campaign whose DAG is its segment chain only, for the
pre-queueing story (tests/pipeline/test_prequeue.py) and the goodput bench
(tests/bench/bench_goodput.py).

The data stage's own jobscripts make a tokenizer and one Megatron prefix in-process (no data
stage in the DAG); each campaign YAML in ``<dags>/campaigns/`` becomes a DAG
``segments__<name>`` of ``segment_1 -> ... -> segment_N`` real ``TrainingSegmentOperator``s
(no preflight, export or evaluation: what these measure is the chain). A campaign with
``health.evaluate_checkpoints`` gets the health segments, which announce their checkpoints,
and its evaluation DAG (transformers backend), as the campaign factory builds them.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import yaml

from tests.support import cluster

# Airflow's safe mode parses only files that say "airflow" and "dag".
DAG_FILE = '''"""Airflow DAGs: the segment chain of each campaign beside this file (airflow dag)."""
from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG

from operators.campaign.dag.dag_factory import START, segment_chain
from operators.campaign.dag.eval_dag import build_eval_dag
from operators.campaign.dag.health import HealthSegmentOperator, uses_health
from operators.campaign.schema.load import load_campaign

for _path in sorted((Path(__file__).parent / "campaigns").glob("*.yaml")):
    _campaign = load_campaign(_path)
    with DAG(f"segments__{_campaign.name}", schedule=None, start_date=datetime(2026, 1, 1),
             catchup=False, tags=["test"]) as _dag:
        if uses_health(_campaign):
            segment_chain(_campaign, HealthSegmentOperator)
        else:
            segment_chain(_campaign)
    globals()[_dag.dag_id] = _dag
    if _campaign.health.evaluate_checkpoints:
        _eval = build_eval_dag(_campaign, START, backend="transformers")
        globals()[_eval.dag_id] = _eval
'''
WORDS = ("the", "model", "trains", "on", "tokens", "and", "saves", "checkpoints", "while",
         "each", "segment", "resumes", "from", "the", "last", "one", "the", "cluster", "kept")
# The trainer's iteration line (jobscripts/megatron_log.py), not the validation line.
_ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|")


def dag_id(name: str) -> str:
    return f"segments__{name}"


def prepare_data(root: Path) -> tuple[str, str]:
    """A tokenizer and one Megatron prefix under ``root``, by the data stage's jobscripts
    (in-process), readable by the cluster user."""
    from jobscripts import tokenize_megatron, train_tokenizer
    from tests.support.data_stage import ok, tokenize_argv

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    rng = random.Random(0)
    with open(corpus / "shard_000.jsonl", "w", encoding="utf-8") as handle:
        for i in range(400):
            text = " ".join(rng.choice(WORDS) for _ in range(200))
            handle.write(json.dumps({"id": str(i), "text": text}) + "\n")
    ok(train_tokenizer.main, ["--output-dir", str(root / "tokenizer"), "--input", str(corpus),
                              "--vocab-size", "512", "--no-verify"], root / "tokenizer.json")
    result = ok(tokenize_megatron.main, tokenize_argv(corpus, root / "tokenizer", root / "data"),
                root / "tokenize.json")
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(root)], check=True)
    return str(root / "tokenizer"), result["prefixes"][0]


def campaign_doc(name: str, root: Path, tokenizer: str, prefix: str, *, segments: int,
                 iters: int, depth: int, retries: int = 0,
                 hang_timeout_min: float | None = None,
                 evaluate_checkpoints: bool = False) -> dict:
    """``segments`` segments of ``iters`` iterations each, pre-queued ``depth`` ahead; the
    segments load ``tokenizer`` from where it is (``data.tokenizer.path``); with
    ``evaluate_checkpoints`` each checkpoint is evaluated as it lands (docs/health.md)."""
    extra = {} if hang_timeout_min is None else {"hang_timeout_min": hang_timeout_min}
    health = {"health": {"evaluate_checkpoints": True}} if evaluate_checkpoints else {}
    return {
        "name": name, "description": "reference segments chained on the local cluster",
        "schedule": None,
        "cluster": {"ssh_conn_id": cluster.CONN_ID, "partition": "debug", "gpus_per_node": 0,
                    "cpus_per_task": 1, "mem": "2G", "time_limit": "5",
                    "remote_root": str(root / "campaigns")},
        "data": {"prefixes": [prefix], "split": "95,5,0", "tokenizer": {"path": tokenizer}},
        "model": {"reference": {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "ffn_hidden_size": 176}},
        "training": {"train_iters": segments * iters, "global_batch_size": 8,
                     "micro_batch_size": 4, "seq_length": 128, "lr": 2.0e-3, "min_lr": 2.0e-4,
                     "lr_warmup_iters": 2, "seed": 7},
        "checkpoint": {"save_interval": iters, "keep_last": 2},
        "validation": {"eval_interval": iters, "eval_iters": 1},
        "logging": {"log_interval": 1},
        "tracking": {"enabled": False},
        "retries": {"train": {"retries": retries, "retry_delay": 1,
                              "exponential_backoff": False}},
        "segments": {"max_per_run": segments, "iters_per_segment": iters,
                     "startup_estimate_min": 1, "save_estimate_s": 5, "margin_min": 2,
                     "prequeue_depth": depth, **extra},
        **health,
    }


def write_dags(dags: Path, docs: list[dict]) -> Path:
    (dags / "campaigns").mkdir(parents=True, exist_ok=True)
    for doc in docs:
        (dags / "campaigns" / f"{doc['name']}.yaml").write_text(
            yaml.safe_dump(doc, sort_keys=False))
    (dags / "segment_chains.py").write_text(DAG_FILE)
    return dags


def segment_records(root: Path, name: str) -> list[dict]:
    """The campaign's segments.jsonl (one line per finished segment task)."""
    path = root / "campaigns" / name / "segments.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_iterations(log_text: str) -> list[int]:
    """Every iteration a job's log shows trained, in order."""
    return [int(m.group(1)) for m in _ITERATION.finditer(log_text)]

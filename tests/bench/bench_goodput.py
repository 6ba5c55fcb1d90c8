"""Benchmark: goodput of a real reference campaign chained serially by Airflow (issue 15 §5).

    python -m tests.bench.bench_goodput      (from the repository root; not collected by pytest)

One campaign of four 5-iteration segments (the reference trainer on a tiny Llama, tracking
off, no data stage: its tokenizer and Megatron dataset are made here first, in-process, by
the data stage's own jobscripts) runs under a real ``airflow standalone`` on the local
cluster, each segment submitted after the one before ended, as today. Then
operators/tracking/goodput.py computes its figures from the segment records and job logs, as
the campaign's register step does. Prints one JSON line:

``{"bench": "goodput", "segments": N, "serial_gap_s": X, "startup_s": X,
"goodput_serial": X, ...}``: the gap is one segment job's sacct End to the next one's Start
(median), start-up a job's Start to its first training step (median), reported apart;
goodput = training-step time / allocated time. Pre-queueing (issue 15 §1) is not part of it.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from tests.support import cluster
from tests.support.airflow import Standalone, airflow_env

NAME = "bench_goodput"
DAG_ID = f"pretrain__{NAME}"
ROOT = Path("/home/pretrain/pp-bench-goodput")  # the cluster user's; the campaign lives here
SEGMENTS, ITERS = 4, 5
# Airflow's safe mode parses only files that say "airflow" and "dag".
DAG_FILE = '''"""Airflow DAG of the goodput bench's campaign (tests/bench/bench_goodput.py)."""
from pathlib import Path

from operators.campaign.dag.dag_factory import build_all

build_all(Path(__file__).parent / "campaigns", globals())
'''
WORDS = ("the", "model", "trains", "on", "tokens", "and", "saves", "checkpoints", "while",
         "each", "segment", "resumes", "from", "the", "last", "one", "the", "cluster", "kept")


def prepare_data(root: Path) -> tuple[str, str]:
    """A tokenizer and one Megatron prefix, by the data stage's jobscripts (in-process)."""
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
    return str(root / "tokenizer"), result["prefixes"][0]


def campaign_yaml(tokenizer: str, prefix: str) -> str:
    doc = {
        "name": NAME, "description": "goodput bench: four short reference segments",
        "schedule": None,
        "cluster": {"ssh_conn_id": cluster.CONN_ID, "partition": "debug", "gpus_per_node": 0,
                    "cpus_per_task": 1, "mem": "2G", "time_limit": "5",
                    "remote_root": str(ROOT / "campaigns")},
        "data": {"prefixes": [prefix], "split": "95,5,0", "tokenizer": {"path": tokenizer}},
        "model": {"reference": {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "ffn_hidden_size": 176}},
        "training": {"train_iters": SEGMENTS * ITERS, "global_batch_size": 8,
                     "micro_batch_size": 4, "seq_length": 128, "lr": 2.0e-3, "min_lr": 2.0e-4,
                     "lr_warmup_iters": 2, "seed": 7},
        "checkpoint": {"save_interval": ITERS, "keep_last": 2},
        "validation": {"eval_interval": ITERS, "eval_iters": 1},
        "logging": {"log_interval": 1},
        "tracking": {"enabled": False},
        "retries": {"train": {"retries": 0, "retry_delay": 5}},
        "segments": {"max_per_run": SEGMENTS, "iters_per_segment": ITERS,
                     "startup_estimate_min": 1, "save_estimate_s": 5, "margin_min": 2},
    }
    return yaml.safe_dump(doc, sort_keys=False)


def figures() -> dict:
    from operators.slurm.parse import JobRecord
    from operators.tracking import goodput

    records = [json.loads(line) for line in
               (ROOT / "campaigns" / NAME / "segments.jsonl").read_text().splitlines()]
    jobs = [goodput.segment_job(JobRecord.from_json(r["slurm"]),
                                Path(r["log_path"]).read_text(errors="replace").splitlines(),
                                1, r.get("load_seconds")) for r in records]
    result = goodput.compute(jobs)
    startups = [(run.first_step_at - run.start).total_seconds() for job in jobs
                for run in job.runs if run.first_step_at and run.start]
    return {
        "bench": "goodput", "segments": result.segments,
        "serial_gap_s": result.gap_median_s,
        "startup_s": round(statistics.median(startups), 2) if startups else None,
        "goodput_serial": round(result.goodput, 4) if result.goodput is not None else None,
        "allocated_node_s": result.allocated_node_s, "train_s": round(result.train_s, 2),
        "save_s": round(result.save_s, 2), "queue_s": result.queue_s,
        "iterations_redone": result.iterations_redone,
    }


def main() -> dict:
    cluster.check_up()
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    tokenizer, prefix = prepare_data(ROOT)
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(ROOT)], check=True)
    home = Path(tempfile.mkdtemp(prefix="pp-bench-goodput-"))
    dags = home / "dags"
    (dags / "campaigns").mkdir(parents=True)
    (dags / "campaigns" / f"{NAME}.yaml").write_text(campaign_yaml(tokenizer, prefix))
    (dags / "campaigns_bench.py").write_text(DAG_FILE)
    # A first start migrates a fresh metadata database: minutes on a loaded 2-core machine.
    af = Standalone(airflow_env(home, dags, port=18096), home / "standalone.log").start(600)
    try:
        t0 = time.time()
        state = af.wait_run(DAG_ID, af.trigger(DAG_ID), timeout=900)
        if state != "success":
            raise SystemExit(f"the bench campaign's DAG run ended {state}")
        wall = time.time() - t0
    finally:
        af.stop()
    return {**figures(), "campaign_wall_s": round(wall, 1)}


if __name__ == "__main__":
    print(json.dumps(main()))

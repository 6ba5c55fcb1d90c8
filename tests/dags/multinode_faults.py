"""Airflow DAGs of the multi-node failure stories under a real triggerer
(tests/pipeline/test_multinode_faults_airflow.py), on the cluster's ``faults`` partition.

- ``multinode_requeue``: one 2-node training segment (always ``--requeue``); a node set DOWN
  under it must be followed by Slurm's requeue under the same job id, in the same try;
- ``multinode_killed_rank``: the same segment, one retry; a rank SIGKILLed must fail the try
  at once and the retry resume from the last checkpoint;
- ``multinode_no_requeue``: a plain 2-node ``--no-requeue`` job, one retry; a node set DOWN
  under it fails the try (NODE_FAIL) and the retry must keep off that node.

Each segment campaign hangs on cue after iteration 3 (the test lays out the fault file;
jobscripts/trainer_faults.py), which gives a fault a moment when the job is certainly
training; the hang watchdog's timeout is far beyond the stories.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import yaml
from airflow.sdk import DAG

from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.schema.load import campaign_from_dict
from operators.slurm.operator import SlurmJobOperator

ROOT = "/home/pretrain/pp-test-campaigns"
PREFIX = f"{ROOT}/multinode_faults_data/synthetic_text_document"
PARTITION = "faults"  # tests/support/cluster.FAULT_PARTITION: docker/local_cluster.sh's
TRAIN_ITERS = 6
SAVE_INTERVAL = 2
HANG_AFTER = 3
REQUEUE, KILLED_RANK, NO_REQUEUE = "multinode_requeue", "multinode_killed_rank", \
    "multinode_no_requeue"
COMMON = {"schedule": None, "start_date": datetime(2026, 1, 1), "catchup": False,
          "tags": ["test"]}
RETRY = {"retries": 1, "retry_delay": timedelta(seconds=1)}


def two_node_campaign(name: str):
    doc = yaml.safe_load((Path(__file__).parents[1] / "campaigns" / "ci_campaign.yaml")
                         .read_text())
    doc.update(name=name, validation={"eval_interval": None},
               checkpoint={"save_interval": SAVE_INTERVAL, "keep_last": 3},
               data={"prefixes": [PREFIX], "split": "90,10,0",
                     "tokenizer": {"path": f"{Path(PREFIX).parent}/tokenizer"}},
               segments={"max_per_run": 1, "startup_estimate_min": 3, "save_estimate_s": 5,
                         "margin_min": 2, "prequeue_depth": 0, "hang_timeout_min": 30})
    doc["cluster"].update(partition=PARTITION, nodes=2, time_limit="10")
    doc["training"].update(train_iters=TRAIN_ITERS, seq_length=64)
    return campaign_from_dict(doc, f"tests/dags/multinode_faults.py:{name}")


CAMPAIGNS = {name: two_node_campaign(name) for name in (REQUEUE, KILLED_RANK)}

with DAG(REQUEUE, **COMMON):
    # No retry: a requeue must be followed within the try that submitted the job.
    TrainingSegmentOperator(task_id="segment_1", campaign=CAMPAIGNS[REQUEUE], segment=1)

with DAG(KILLED_RANK, **COMMON):
    TrainingSegmentOperator(task_id="segment_1", campaign=CAMPAIGNS[KILLED_RANK], segment=1,
                            **RETRY)

with DAG(NO_REQUEUE, **COMMON):
    # Try 1 holds both nodes until one is set down; the retry's job (the run directory is the
    # key's, shared by every try) only says where it ran.
    SlurmJobOperator(task_id="hold_two_nodes", ssh_conn_id="slurm_local", poll_interval=2,
                     job={"nodes": 2, "partition": PARTITION, "requeue": False,
                          "time": "10"},
                     command="if [ -e first-try ]; then srun --ntasks-per-node=1 hostname; "
                             "else touch first-try; srun --ntasks-per-node=1 sleep 600; fi",
                     **RETRY)

"""Airflow DAGs of the hang-watchdog test (tests/pipeline/test_hang_watchdog.py): one training
segment of the reference trainer per DAG, a hang timeout of seconds, one retry.

Two campaigns, so that the two runs share nothing: in ``hang_watchdog_term`` the injected hang
ends at SIGTERM (the trainer saves and exits), in ``hang_watchdog_kill`` it ignores it (a rank
stuck in a collective) and only the cancel ends it. The test lays out their data and faults.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import yaml
from airflow.sdk import DAG

from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.schema.load import campaign_from_dict

ROOT = "/home/pretrain/pp-test-campaigns"
DATA = f"{ROOT}/hang_watchdog_data"
PREFIX = f"{DATA}/synthetic_text_document"
TRAIN_ITERS = 12
HANG_TIMEOUT_MIN = 0.2  # 12 s: seconds-long, so that the test is short
NAMES = ("hang_watchdog_term", "hang_watchdog_kill")


def campaign(name: str):
    doc = yaml.safe_load((Path(__file__).parents[1] / "campaigns" / "ci_campaign.yaml")
                         .read_text())
    doc["name"] = name
    doc["data"] = {"prefixes": [PREFIX], "split": "90,10,0",
                   "tokenizer": {"path": f"{DATA}/tokenizer"}}
    doc["training"].update(train_iters=TRAIN_ITERS, seq_length=64)
    doc["checkpoint"] = {"save_interval": 4, "keep_last": 3}
    doc["validation"] = {"eval_interval": None}
    # Start-up took 2 min on the loaded 2-core machine: a 10 min job whose exit timer leaves
    # room for the hang, the stop and the steps after it.
    doc["cluster"]["time_limit"] = "10"
    doc["segments"] = {"max_per_run": 1, "startup_estimate_min": 3, "save_estimate_s": 5,
                       "margin_min": 2, "prequeue_depth": 0,
                       "hang_timeout_min": HANG_TIMEOUT_MIN}
    return campaign_from_dict(doc, f"tests/dags/hang_watchdog.py:{name}")


CAMPAIGNS = {name: campaign(name) for name in NAMES}

for _name, _campaign in CAMPAIGNS.items():
    with DAG(_name, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
             tags=["test"]):
        TrainingSegmentOperator(task_id="segment_1", campaign=_campaign, segment=1, retries=1,
                                retry_delay=timedelta(seconds=1))

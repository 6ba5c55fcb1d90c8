"""Airflow DAGs of the pre-queueing cancel story (tests/pipeline/test_prequeue.py): each a
small reference campaign's segment chain ``segment_1 -> segment_2 -> segment_3``, pre-queued
one ahead (``segments.prequeue_depth: 1``), on the session's ``airflow standalone``.

``prequeue_cancel_<how>``: segment 1 hangs (the reference trainer's test-only fault, laid out
by the test) while segment 2's job waits behind it; the test then marks segment 1 failed,
clears it, or marks the run failed. The hang watchdog's timeout is far beyond the test, so
that only those actions end the jobs.

The test lays out the data (tests/support/reference_campaign.py ``prepare_data``) and the
campaign files under ROOT before it triggers anything, and removes the campaign files after:
without them this file defines no DAG.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG

from operators.campaign.dag.dag_factory import segment_chain
from operators.campaign.schema.load import load_campaign

ROOT = Path("/home/pretrain/pp-test-prequeue-dags")
# The campaigns' YAML, written by the test (tests/pipeline/test_prequeue.py: campaign_doc):
# the DAG processor cannot import the tests' support code, and the DAGs appear once the
# test has laid out their data.
CAMPAIGNS_DIR = ROOT / "campaigns-yaml"
TOKENIZER = ROOT / "tokenizer"
PREFIX = ROOT / "data" / "shard_000_text_document"  # prepare_data's one shard
SEGMENTS, ITERS = 3, 4
CANCEL_HOWS = ("failed", "clear", "runfail")
CANCEL = {how: f"prequeue_cancel_{how}" for how in CANCEL_HOWS}


def dag_id(name: str) -> str:
    return f"prequeue__{name}"


for _path in sorted(CAMPAIGNS_DIR.glob("*.yaml")):
    _campaign = load_campaign(_path)
    with DAG(dag_id(_campaign.name), schedule=None, start_date=datetime(2026, 1, 1),
             catchup=False, tags=["test"]) as _dag:
        segment_chain(_campaign)
    globals()[_dag.dag_id] = _dag

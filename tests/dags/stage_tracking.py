"""Non-training stages tracked in MLflow (tests/tracking/test_stage_tracking.py).

A tracked copy of the CI campaign, ``stage_tracked``: its raw gate runs on a corpus the test
fills with duplicates, so it fails (GX still writes its Data Docs); its evaluate stage writes a
known result. The test writes the corpus and gives the MLflow connection ``mlflow_stage_test``.
One GX job only: each costs 10-30 s on 2 cores, and a passing gate is tracked by the same code
as the passing evaluate stage.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import yaml
from airflow.sdk import DAG

from operators.campaign.dag.stage_operator import CampaignStageOperator
from operators.campaign.render import stages
from operators.campaign.render.layout import RESULT_FILE, Layout
from operators.campaign.schema.load import campaign_from_dict

ROOT = "/home/pretrain/pp-test-stage-tracking"
MLFLOW_CONN = "mlflow_stage_test"
# What jobscripts/evaluate.py writes, with known figures: a real evaluation needs an exported
# model, which tests/export_eval and tests/pipeline build; here only its tracking is at stake.
EVAL_RESULT = ('{"ok": true, "step": "evaluate", "perplexity": 12.5, "bits_per_byte": 1.25, '
               '"nll_per_token": 2.5257, "tokens_evaluated": 4096, "samples": []}')


def _campaign():
    raw = yaml.safe_load((Path(__file__).parents[1] / "campaigns" / "ci_campaign.yaml")
                         .read_text())
    raw["name"] = "stage_tracked"
    raw["cluster"]["remote_root"] = ROOT
    raw["tracking"] = {"enabled": True, "mlflow_conn_id": MLFLOW_CONN}
    return campaign_from_dict(raw)


CAMPAIGN = _campaign()
LAYOUT = Layout.for_campaign(CAMPAIGN)

with DAG("stage_tracking", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         tags=["test"]):
    CampaignStageOperator(task_id="raw_gate", campaign=CAMPAIGN, stage="raw_gate",
                          poll_interval=1, **stages.raw_gate(CAMPAIGN, LAYOUT))
    CampaignStageOperator(task_id="evaluate", campaign=CAMPAIGN, stage="evaluate",
                          poll_interval=1, job=stages.stage_job(CAMPAIGN),
                          result_file=RESULT_FILE,
                          command=f"printf '%s' '{EVAL_RESULT}' > {RESULT_FILE}")

"""Airflow DAGs of tests/campaigns/health/ (tests/pipeline/test_checkpoint_eval.py and
test_loss_spike_hold.py): the campaign DAG and its evaluation DAG, built by the same factory
as dags/. The evaluation DAG scores with the transformers backend here: vLLM's CPU build costs
about a minute of engine start per checkpoint on 2 cores, and both backends' figures are
compared by tests/export_eval."""

from pathlib import Path

from operators.campaign.dag.dag_factory import build_dag
from operators.campaign.schema.load import load_campaign

HEALTH_EVAL = load_campaign(Path(__file__).parents[1] / "campaigns" / "health" /
                            "health_eval.yaml")
HEALTH_SPIKE = load_campaign(Path(__file__).parents[1] / "campaigns" / "health" /
                             "health_spike.yaml")
health_eval_dag = build_dag(HEALTH_EVAL, eval_backend="transformers")
health_spike_dag = build_dag(HEALTH_SPIKE)

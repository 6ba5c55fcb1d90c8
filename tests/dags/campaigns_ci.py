"""Airflow DAGs for the test campaigns in tests/campaigns/ (same factory as dags/)."""

from pathlib import Path

from operators.campaign.dag.dag_factory import build_all

build_all(Path(__file__).parents[1] / "campaigns", globals())

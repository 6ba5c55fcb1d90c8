"""Airflow DAGs of the production-stack tests' campaigns (tests/stack/campaigns/)."""

from pathlib import Path

from operators.campaign.dag.dag_factory import build_all

build_all(Path(__file__).parents[1] / "campaigns", globals())

"""The MLflow run's extra link on a campaign task: the task pushes the run's URL to XCom under
the link's key once the run exists (operators/campaign/adapters/tracking.py)."""

from __future__ import annotations

from operators.slurm.links import XComLink


class MlflowRunLink(XComLink):
    name = "MLflow run"


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"

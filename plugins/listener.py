"""Ends a campaign's MLflow parent run with its DAG run: FINISHED on success, FAILED else.

Runs in the scheduler. The run is found by its ``pp.campaign`` tag, so the listener needs
neither the cluster nor the task's XComs; MLflow being down only logs a warning.
"""

from __future__ import annotations

import logging

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)
DAG_PREFIX = "pretrain__"
MLFLOW_CONN_ID = "mlflow_default"


def end_campaign_run(campaign: str, status: str, conn_id: str = MLFLOW_CONN_ID) -> int:
    """Set every RUNNING run tagged with ``campaign`` to ``status``; returns how many.

    No MLflow connection means no tracking here: return before importing mlflow, which
    takes seconds the scheduler should not spend on every campaign run.
    """
    from airflow.sdk.bases.hook import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        log.debug("no %s connection: campaign %s is not tracked", conn_id, campaign)
        return 0
    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings

    client = make_client(tracking_settings(conn))
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=(
        f"tags.`pp.campaign` = '{campaign}' and attributes.status = 'RUNNING'"))
    for run in runs:
        if run.data.tags.get("mlflow.parentRunId") is None:
            client.set_terminated(run.info.run_id, status)
    return len(runs)


def _on_end(dag_run, status: str) -> None:
    if not dag_run.dag_id.startswith(DAG_PREFIX):
        return
    try:
        ended = end_campaign_run(dag_run.dag_id[len(DAG_PREFIX):], status)
        log.info("%s: MLflow campaign run(s) set %s: %s", dag_run.dag_id, status, ended)
    except Exception as exc:  # noqa: BLE001 - a listener must never break the scheduler
        log.warning("%s: could not end the MLflow run: %s", dag_run.dag_id, exc)


class CampaignRunListener:
    @hookimpl
    def on_dag_run_success(self, dag_run, msg: str) -> None:
        _on_end(dag_run, "FINISHED")

    @hookimpl
    def on_dag_run_failed(self, dag_run, msg: str) -> None:
        _on_end(dag_run, "FAILED")

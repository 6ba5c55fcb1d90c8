"""Ends a campaign's MLflow parent run with its DAG run: FINISHED on success, FAILED else.

Runs in the scheduler. The run is found by its ``pp.campaign`` tag, so the listener needs
neither the cluster nor the task's XComs; MLflow being down only logs a warning. The MLflow
connection is the campaign's own ``tracking.mlflow_conn_id``, read from the DAG's
``mlflow_conn:<id>`` tag (operators/tracking/names.py); a DAG without it is not tracked.

The MLflow part runs on a thread of its own. The scheduler calls the listener from inside
``DagRun.update_state`` with its session open; looking the connection up and talking to MLflow
there took seconds of the scheduling loop, and under the real scheduler (a connection created
in the UI, a failed campaign run) the scheduler then died on ``DetachedInstanceError`` for that
DagRun. Airflow's ORM session is thread-local: on its own thread the lookup cannot touch the
scheduler's. What the listener needs from the DagRun is read before the thread starts.
"""

from __future__ import annotations

import logging
import threading

from airflow.listeners import hookimpl

from operators.campaign.schema.naming import campaign_of_dag
from operators.tracking.names import CAMPAIGN_TAG, PARENT_TAG, conn_id_from_dag_tags

log = logging.getLogger(__name__)


def end_campaign_run(campaign: str, status: str, conn_id: str) -> int:
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
        f"tags.`{CAMPAIGN_TAG}` = '{campaign}' and attributes.status = 'RUNNING'"))
    for run in runs:
        if run.data.tags.get(PARENT_TAG) is None:
            client.set_terminated(run.info.run_id, status)
    return len(runs)


def _dag_tags(dag_run) -> list[str]:
    # The scheduler hands over the run with its serialized DAG; the REST API's state change
    # may not, and then the DAG's tags come from its DagModel.
    dag = getattr(dag_run, "dag", None)
    if dag is not None:
        return list(dag.tags or ())
    model = getattr(dag_run, "dag_model", None)
    return [t.name for t in getattr(model, "tags", None) or ()]


_ENDING: list[threading.Thread] = []


def _end_quietly(dag_id: str, campaign: str, status: str, conn_id: str) -> None:
    try:
        ended = end_campaign_run(campaign, status, conn_id)
        log.info("%s: MLflow campaign run(s) set %s: %s", dag_id, status, ended)
    except Exception as exc:  # noqa: BLE001 - a listener must never break the scheduler
        log.warning("%s: could not end the MLflow run: %s", dag_id, exc)


def _on_end(dag_run, status: str) -> None:
    dag_id = dag_run.dag_id
    campaign = campaign_of_dag(dag_id)
    if campaign is None:
        return
    try:
        conn_id = conn_id_from_dag_tags(_dag_tags(dag_run))
    except Exception as exc:  # noqa: BLE001 - as above
        log.warning("%s: could not read the DAG's tags: %s", dag_id, exc)
        return
    if conn_id is None:
        log.debug("%s: tracking is off", dag_id)
        return
    # A daemon: a scheduler that exits does not wait for MLflow (the run stays RUNNING).
    thread = threading.Thread(target=_end_quietly, args=(dag_id, campaign, status, conn_id),
                              name=f"pp-end-mlflow-run-{dag_id}", daemon=True)
    _ENDING[:] = [t for t in _ENDING if t.is_alive()] + [thread]
    thread.start()


def wait_for_ended_runs(timeout: float = 60.0) -> None:
    """Until the MLflow runs of the DAG runs ended so far are ended (tests, and a caller that
    must not exit first)."""
    for thread in list(_ENDING):
        thread.join(timeout)


class CampaignRunListener:
    @hookimpl
    def on_dag_run_success(self, dag_run, msg: str) -> None:
        _on_end(dag_run, "FINISHED")

    @hookimpl
    def on_dag_run_failed(self, dag_run, msg: str) -> None:
        _on_end(dag_run, "FAILED")

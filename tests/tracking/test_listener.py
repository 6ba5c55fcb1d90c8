"""The scheduler's listener ends a campaign's parent run through the campaign's own MLflow
connection (``tracking.mlflow_conn_id``, carried by the DAG's tag), on the real server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from operators.campaign.schema.load import campaign_from_dict
from operators.campaign.schema.naming import dag_id
from operators.tracking import names, runs
from plugins import listener
from tests.campaign.util import DEMO, edited, raw

CONN_ID = "campaign_tracking"  # not mlflow_default: the listener must not assume it


@pytest.fixture
def parent(client, experiment, monkeypatch, mlflow_server) -> tuple[str, str]:
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", mlflow_server.airflow_conn_json())
    name = experiment  # unique per test: the listener ends every RUNNING run of the campaign
    run_id = runs.ensure_campaign_run(client, experiment, name)
    return name, run_id


def _dag_run(campaign: str, tags: list[str]):
    return SimpleNamespace(dag_id=f"pretrain__{campaign}", dag=SimpleNamespace(tags=set(tags)))


def test_parent_run_ends_through_the_campaigns_connection(client, parent) -> None:
    campaign, run_id = parent
    listener.CampaignRunListener().on_dag_run_success(
        _dag_run(campaign, ["pretrain", names.conn_dag_tag(CONN_ID)]), msg="")
    listener.wait_for_ended_runs()
    assert client.get_run(run_id).info.status == "FINISHED"


def test_untracked_campaign_dag_ends_nothing(client, parent) -> None:
    campaign, run_id = parent
    listener.CampaignRunListener().on_dag_run_failed(_dag_run(campaign, ["pretrain"]), msg="")
    listener.wait_for_ended_runs()
    assert client.get_run(run_id).info.status == "RUNNING"


def test_mlflow_is_called_off_the_schedulers_thread(client, parent) -> None:
    """The scheduler's ORM session is thread-local: the connection lookup and the MLflow calls
    run on another thread, and the listener returns before they end (the scheduler died on a
    DetachedInstanceError when they ran inside its ``update_state``)."""
    import threading

    campaign, run_id = parent
    started = threading.Event()
    seen = {}
    real = listener.end_campaign_run

    def slow_end(*args):
        seen["thread"] = threading.get_ident()
        started.wait(30)  # the listener has returned by then
        return real(*args)

    mp = pytest.MonkeyPatch()
    mp.setattr(listener, "end_campaign_run", slow_end)
    try:
        listener.CampaignRunListener().on_dag_run_failed(
            _dag_run(campaign, ["pretrain", names.conn_dag_tag(CONN_ID)]), msg="")
        assert client.get_run(run_id).info.status == "RUNNING"  # not waited for
        started.set()
        listener.wait_for_ended_runs()
    finally:
        mp.undo()
    assert seen["thread"] != threading.get_ident()
    assert client.get_run(run_id).info.status == "FAILED"


def test_dag_tags_name_the_campaigns_connection_when_tracked() -> None:
    from operators.campaign.dag.dag_factory import build_dag

    tracked = campaign_from_dict(edited(raw(DEMO), {"tracking.mlflow_conn_id": CONN_ID}))
    dag = build_dag(tracked)
    assert dag.dag_id == dag_id(tracked)
    assert names.conn_id_from_dag_tags(dag.tags) == CONN_ID
    off = campaign_from_dict(edited(raw(DEMO), {"tracking.enabled": False}))
    assert names.conn_id_from_dag_tags(build_dag(off).tags) is None

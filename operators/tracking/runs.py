"""The runs of a campaign: one parent run for its whole life, a child run per stage/segment.

The parent's id is stored by the Airflow side in a file beside the checkpoints, so every DAG
run and segment continues it (docs/tracking.md). Children are found again by a key tag, so an
Airflow retry of a task continues its child run instead of starting a second one.

mlflow is imported inside the functions that need it.
"""

from __future__ import annotations

import logging

from operators.tracking.names import (
    CAMPAIGN_KIND,
    CAMPAIGN_TAG,
    CHILD_KEY_TAG,
    KIND_TAG,
    PARENT_TAG,
)

log = logging.getLogger(__name__)

TERMINAL = ("FINISHED", "FAILED", "KILLED")


def _error_code(exc: Exception) -> str | None:
    return getattr(exc, "error_code", None)


def ensure_experiment(client, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id, created (with ``artifact_location``) on first use."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as exc:  # created meanwhile by someone else
        if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def _existing(client, run_id: str):
    """The run, or None when it does not exist (or was deleted in the UI)."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if _error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return None if run.info.lifecycle_stage == "deleted" else run


def _reopen(client, run) -> None:
    if run.info.status != "RUNNING":
        client.update_run(run.info.run_id, status="RUNNING")


def ensure_campaign_run(client, experiment: str, campaign_name: str,
                        stored_run_id: str | None = None, *, tags: dict | None = None,
                        artifact_location: str | None = None, reopen: bool = True) -> str:
    """The campaign's parent run id: ``stored_run_id`` re-opened (status RUNNING) when that run
    exists, else a new run in ``experiment``. A deleted or unknown stored id starts a new run
    (logged): its metrics cannot be continued anyway.

    ``reopen=False`` is for work that logs beside the campaign's DAG run rather than in it (a
    checkpoint's evaluation, which may end after the DAG run did): the run keeps its status,
    since nothing would end it again once the campaign's DAG run is over."""
    if stored_run_id:
        run = _existing(client, stored_run_id)
        if run is not None:
            if reopen:
                _reopen(client, run)
            return stored_run_id
        log.warning("stored MLflow run %s of campaign %s is gone; starting a new parent run",
                    stored_run_id, campaign_name)
    experiment_id = ensure_experiment(client, experiment, artifact_location)
    run_tags = {**(tags or {}), CAMPAIGN_TAG: campaign_name, KIND_TAG: CAMPAIGN_KIND}
    return client.create_run(experiment_id, run_name=campaign_name, tags=run_tags).info.run_id


def _quoted(value: str, what: str) -> str:
    # MLflow's filter grammar has no escape that every backend store honours.
    if "'" in value or "\\" in value:
        raise ValueError(f"{what} {value!r} must not contain quotes or backslashes")
    return f"'{value}'"


def find_child(client, parent_id: str, key: str, experiment_id: str | None = None):
    """The oldest live child of ``parent_id`` tagged with ``key``, or None."""
    if experiment_id is None:
        experiment_id = client.get_run(parent_id).info.experiment_id
    query = (f"tags.`{PARENT_TAG}` = {_quoted(parent_id, 'parent run id')} and "
             f"tags.`{CHILD_KEY_TAG}` = {_quoted(key, 'child key')}")
    found = client.search_runs([experiment_id], query, max_results=1,
                               order_by=["attributes.start_time ASC"])
    return found[0] if found else None


def child_run(client, parent_id: str, name: str, tags: dict | None = None, *,
              key: str | None = None) -> str:
    """A child run of ``parent_id``, idempotent by ``key`` (default ``name``): a second call
    with the same key returns the first call's run, re-opened. Build the key from what
    identifies the work and not the attempt (dag run id + task id + segment)."""
    key = key or name
    parent = client.get_run(parent_id)
    experiment_id = parent.info.experiment_id
    existing = find_child(client, parent_id, key, experiment_id)
    if existing is not None:
        _reopen(client, existing)
        return existing.info.run_id
    run_tags = {**(tags or {}), PARENT_TAG: parent_id, CHILD_KEY_TAG: key}
    campaign = parent.data.tags.get(CAMPAIGN_TAG)
    if campaign:
        run_tags.setdefault(CAMPAIGN_TAG, campaign)
    return client.create_run(experiment_id, run_name=name, tags=run_tags).info.run_id


def finish_run(client, run_id: str, status: str = "FINISHED") -> None:
    if status not in TERMINAL:
        raise ValueError(f"status {status!r} is not one of {', '.join(TERMINAL)}")
    client.set_terminated(run_id, status)

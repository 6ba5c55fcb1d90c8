"""The campaign's MLflow records, from the Airflow side. Never blocks training.

One parent run per campaign, its id stored beside the checkpoints on the cluster
(``<campaign>/mlflow_run_id``), so every DAG run and segment continues it. Each
segment is a child run with its Slurm accounting; its metrics (step = iteration)
go to both the child and the parent, so the parent holds one continuous loss
curve. When MLflow is down the tracker spools to local disk and sends later.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from operators.campaign.layout import Layout
from operators.campaign.remote import read_text, write_file

SPOOL_ROOT_ENV = "PP_TRACKING_SPOOL"  # where records wait while MLflow is down


def open_tracker(campaign):
    """The campaign's :class:`Tracker`, or None when tracking is off."""
    if not campaign.tracking.enabled:
        return None
    from airflow.sdk.bases.hook import BaseHook

    from operators.tracking.client import make_client
    from operators.tracking.settings import tracking_settings
    from operators.tracking.tracker import Tracker

    conn = BaseHook.get_connection(campaign.tracking.mlflow_conn_id)
    root = Path(os.environ.get(SPOOL_ROOT_ENV)
                or Path(os.environ.get("AIRFLOW_HOME", tempfile.gettempdir())) / "pp-spool")
    return Tracker(make_client(tracking_settings(conn)), root / campaign.name)


def experiment_name(campaign, tracker) -> str:
    settings = getattr(tracker.client, "settings", None)
    return (campaign.tracking.experiment or (settings.experiment if settings else None)
            or campaign.name)


def campaign_run(tracker, campaign, hook, layout: Layout) -> str | None:
    """The campaign's parent run id, created on first use and stored on the cluster."""
    stored = (read_text(hook, layout.mlflow_run_id) or "").strip() or None
    run_id = tracker.campaign_run(experiment_name(campaign, tracker), campaign.name, stored,
                                  tags={"pp.campaign": campaign.name})
    if run_id and run_id != stored:
        write_file(hook, layout.mlflow_run_id, run_id)
        tracker.log_params(run_id, campaign.model_dump(mode="json"))
    return run_id


def _log_file(tracker, run_id: str | None, name: str, content: bytes | str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        tracker.log_artifact(run_id, path)


def _link_run(tracker, ti, run_id: str | None) -> None:
    """The task's "MLflow run" extra link."""
    from operators.slurm.links import MlflowRunLink, mlflow_run_url

    real = tracker.resolve(run_id)
    if real:
        experiment = tracker.client.get_run(real).info.experiment_id
        ti.xcom_push(key=MlflowRunLink().xcom_key,
                     value=mlflow_run_url(tracker.client.tracking_uri, experiment, real))


def track_segment(campaign, hook, layout: Layout, context, summary: dict[str, Any],
                  files: dict[str, str]) -> None:
    """Metrics, accounting and artifacts of one finished segment."""
    from operators.campaign import logparse
    from operators.slurm.trigger import record_from_payload

    tracker = open_tracker(campaign)
    if tracker is None:
        return
    tracker.flush()
    parent = campaign_run(tracker, campaign, hook, layout)
    ti = context["ti"]
    child = tracker.child_run(parent, f"{ti.task_id} ({ti.run_id})",
                              tags={"pp.stage": "train", "pp.segment": ti.task_id},
                              key=f"{ti.run_id}/{ti.task_id}/{ti.map_index}")
    _link_run(tracker, ti, child)
    log = hook.read_bytes(summary["log_path"], 0, 256 << 20).decode("utf-8", "replace")
    records = list(logparse.parse_lines(log.splitlines()))
    t = campaign.training
    job = record_from_payload(summary["record"])
    # The job's start as every value's timestamp: a retried task re-sends the same values,
    # which MLflow then drops instead of doubling the curve.
    stamp = int(job.start.timestamp() * 1000) if job.start else None
    for run_id in (child, parent):
        tracker.log_metrics(run_id, records, seq_length=t.seq_length,
                            global_batch_size=t.global_batch_size, timestamp_ms=stamp)
    result = summary.get("result") or {}
    tracker.log_accounting(child, job, step=result.get("end_iteration") or 0)
    if result.get("checkpoint"):
        tracker.record_checkpoint(parent, result["checkpoint"]["path"],
                                  result["checkpoint"].get("iteration"))
    for name, content in {**files, "job.log": log}.items():
        _log_file(tracker, child, name, content)
    tracker.finish(child, "FINISHED")


def register(campaign, hook, layout: Layout, iteration: int,
             evaluation: dict[str, Any] | None) -> dict[str, Any] | None:
    """Register the exported model with lineage tags and the alias ``candidate``.

    The export directory is read from the Airflow machine's file system: true for
    the local cluster; on a real cluster it must be shared (or synced) with Airflow.
    """
    import hashlib

    from operators.tracking.registry import Lineage, register_model

    tracker = open_tracker(campaign)
    if tracker is None:
        return None
    parent = campaign_run(tracker, campaign, hook, layout)
    manifest = read_text(hook, layout.pinned_manifest)
    config = campaign.model_dump_json()
    lineage = Lineage(
        campaign=campaign.name, iteration=iteration,
        dataset_manifest_hash=hashlib.sha256(manifest.encode()).hexdigest() if manifest else None,
        config_hash=hashlib.sha256(config.encode()).hexdigest())
    reg = register_model(tracker.client, f"pretrain-{campaign.name}", parent, layout.hf_export,
                         lineage, evaluation=evaluation)
    return {"name": reg.name, "version": reg.version, "run_id": reg.run_id,
            "created": reg.created}

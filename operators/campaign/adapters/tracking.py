"""The campaign's MLflow records, from the Airflow side. Never blocks training.

One parent run per campaign, its id stored beside the checkpoints on the cluster
(``<campaign>/mlflow_run_id``), so every DAG run and segment continues it. Each
segment is a child run with its Slurm accounting; its metrics (step = iteration)
go to both the child and the parent, so the parent holds one continuous loss
curve. Every other stage (data stage, export, evaluate) is a child run too, tagged
``pp.stage``, with its job script, log, result JSON and own reports, whether the job
succeeded or failed. When MLflow is down the tracker spools to local disk and sends later.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from operators.campaign.adapters.remote import read_text, write_file
from operators.campaign.render.layout import Layout
from operators.tracking import names

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
    from operators.slurm.hook import SlurmHook
    from operators.slurm.messages import JobSummary
    from operators.tracking.tracker import Tracker

SPOOL_ROOT_ENV = "PP_TRACKING_SPOOL"  # where records wait while MLflow is down
JOB_LOG_LIMIT = 8 << 20  # a stage's job log is uploaded up to its last 8 MiB
EVALUATE_STAGE = "evaluate"  # its figures also go on the campaign's run


def open_tracker(campaign: Campaign):
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


def experiment_name(campaign: Campaign, tracker: Tracker) -> str:
    settings = getattr(tracker.client, "settings", None)
    return (campaign.tracking.experiment or (settings.experiment if settings else None)
            or campaign.name)


def campaign_run(tracker: Tracker, campaign: Campaign, hook: SlurmHook,
                 layout: Layout, *, reopen: bool = True) -> str | None:
    """The campaign's parent run id, created on first use and stored on the cluster;
    ``reopen``: as ``runs.ensure_campaign_run``'s."""
    stored = (read_text(hook, layout.mlflow_run_id) or "").strip() or None
    run_id = tracker.campaign_run(experiment_name(campaign, tracker), campaign.name, stored,
                                  tags={names.CAMPAIGN_TAG: campaign.name}, reopen=reopen)
    if run_id and run_id != stored:
        write_file(hook, layout.mlflow_run_id, run_id)
        tracker.log_params(run_id, campaign.model_dump(mode="json"))
    return run_id


def _log_files(tracker: Tracker, run_id: str | None, files: Mapping[str, bytes | str]) -> None:
    """``files`` (artifact path -> content) as one upload per top-level folder, not per file:
    a GX Data Docs tree is dozens of files. Empty contents (a file that was not there) are
    left out."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, content in files.items():
            parts = PurePosixPath(name).parts
            if not content or name.startswith("/") or ".." in parts:
                continue
            path = root.joinpath(*parts)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else content)
        for entry in sorted(root.iterdir()):
            tracker.log_artifact(run_id, entry, entry.name if entry.is_dir() else None)


def _link_run(tracker: Tracker, ti, run_id: str | None) -> None:
    """The task's "MLflow run" extra link."""
    from operators.tracking.links import MlflowRunLink, mlflow_run_url

    real = tracker.resolve(run_id)
    if real:
        experiment = tracker.client.get_run(real).info.experiment_id
        ti.xcom_push(key=MlflowRunLink().xcom_key,
                     value=mlflow_run_url(tracker.client.tracking_uri, experiment, real))


def _task_child(tracker: Tracker, parent: str | None, ti, tags: Mapping[str, str]) -> str | None:
    """This task instance's child run of ``parent``, keyed by DAG run, task and map index but
    not the try: a retry continues the same run."""
    child = tracker.child_run(parent, f"{ti.task_id} ({ti.run_id})", tags=tags,
                              key=f"{ti.run_id}/{ti.task_id}/{ti.map_index}")
    _link_run(tracker, ti, child)
    return child


def _job_start_ms(summary: JobSummary) -> int | None:
    """The job's start as the timestamp of every value it produced: a retried task re-sends
    the same values, which MLflow then drops instead of doubling the curve."""
    start = summary.record.start
    return int(start.timestamp() * 1000) if start else None


def _log_job(tracker: Tracker, child: str | None, hook: SlurmHook, summary: JobSummary,
             files: Mapping[str, bytes | str], *, log: str | None = None, step: int = 0,
             status: str = "FINISHED") -> None:
    """A finished job on its child run: Slurm accounting, the job script, the job log (the
    last ``JOB_LOG_LIMIT`` bytes unless ``log`` is given) and ``files``; then ends the run."""
    from operators.slurm.hook import SCRIPT_NAME
    from operators.tracking.artifacts import JOBSCRIPTS, LOGS

    tracker.log_accounting(child, summary.record, step=step)
    found: dict[str, bytes | str] = {}
    script = f"{JOBSCRIPTS}/{SCRIPT_NAME}"
    if summary.run_dir and script not in files:
        found[script] = hook.read_bytes(posixpath.join(summary.run_dir, SCRIPT_NAME))
    if summary.log_path:
        found[f"{LOGS}/{posixpath.basename(summary.log_path)}"] = (
            log if log is not None else hook.log_tail(summary.log_path, JOB_LOG_LIMIT))
    _log_files(tracker, child, {**found, **files})
    tracker.finish(child, status)


def _segment_files(files: Mapping[str, str]) -> dict[str, str]:
    """The segment's rendered files (name -> text) under their artifact folders."""
    from operators.slurm.hook import SCRIPT_NAME
    from operators.tracking.artifacts import CONFIGS, JOBSCRIPTS

    return {f"{JOBSCRIPTS if name == SCRIPT_NAME else CONFIGS}/{name}": text
            for name, text in files.items()}


def track_segment(campaign: Campaign, hook: SlurmHook, layout: Layout, context: Context,
                  summary: JobSummary, files: dict[str, str]) -> None:
    """Metrics, accounting and artifacts of one finished segment."""
    from jobscripts import vocabulary
    from operators.tracking import logparse

    tracker = open_tracker(campaign)
    if tracker is None:
        return
    tracker.flush()
    parent = campaign_run(tracker, campaign, hook, layout)
    ti = context["ti"]
    child = _task_child(tracker, parent, ti, {
        names.KIND_TAG: names.SEGMENT_KIND, names.STAGE_TAG: names.TRAIN_STAGE,
        names.SEGMENT_TAG: ti.task_id})
    log = hook.read_bytes(summary.log_path, 0, 256 << 20).decode("utf-8", "replace")
    records = list(logparse.parse_lines(log.splitlines()))
    t = campaign.training
    stamp = _job_start_ms(summary)
    for run_id in (child, parent):
        tracker.log_metrics(run_id, records, seq_length=t.seq_length,
                            global_batch_size=t.global_batch_size, timestamp_ms=stamp)
    fallbacks = [r.detail["reason"] for r in records if r.kind == vocabulary.CHECKPOINT_FALLBACK]
    if fallbacks:  # the trainer said so in the log; the run says so too
        from operators.tracking.artifacts import CHECKPOINT_FALLBACK

        tracker.set_tags(child, {CHECKPOINT_FALLBACK: "; ".join(fallbacks)})
    result = summary.result or {}
    if result.get("checkpoint"):
        tracker.record_checkpoint(parent, result["checkpoint"]["path"],
                                  result["checkpoint"].get("iteration"))
    _log_job(tracker, child, hook, summary, _segment_files(files), log=log,
             step=result.get("end_iteration") or 0)


def _log_evaluation(tracker: Tracker, runs: tuple[str | None, ...], hook: SlurmHook, layout: Layout,
                    summary: JobSummary) -> None:
    """An evaluation's figures on its child run and the campaign's, at step = the campaign's
    checkpoint iteration (the one that was exported), so several evaluations make a curve."""
    from operators.campaign.adapters.remote import read_iteration
    from operators.tracking.registry import eval_metrics

    result = summary.result or {}
    values = eval_metrics(result) if result.get("ok") else {}
    if not values:
        return
    step = read_iteration(hook, layout)
    for run_id in runs:
        tracker.log_values(run_id, values, step, timestamp_ms=_job_start_ms(summary))


def track_stage(campaign: Campaign, hook: SlurmHook, layout: Layout, context: Context,
                stage: str, summary: JobSummary, files: Mapping[str, bytes | str],
                status: str = "FINISHED") -> None:
    """A non-training stage's child run (tag ``pp.stage``): its job, ``files`` (artifact path
    -> content: result JSON, reports, manifest...), ended with ``status``; an evaluation's
    figures also on the campaign's run."""

    tracker = open_tracker(campaign)
    if tracker is None:
        return
    tracker.flush()
    parent = campaign_run(tracker, campaign, hook, layout)
    child = _task_child(tracker, parent, context["ti"],
                        {names.KIND_TAG: names.STAGE_KIND, names.STAGE_TAG: stage})
    if stage == EVALUATE_STAGE:
        _log_evaluation(tracker, (child, parent), hook, layout, summary)
    _log_job(tracker, child, hook, summary, files, status=status)


def _log_goodput(tracker: Tracker, parent: str | None, campaign: Campaign, hook: SlurmHook,
                 layout: Layout, iteration: int) -> None:
    """The trained campaign's goodput on its run (adapters/goodput_log.py); a failure to
    compute it is logged and must not stop the registration."""
    import logging

    from operators.campaign.adapters.goodput_log import log_goodput, segment_jobs

    try:
        log_goodput(tracker, parent, segment_jobs(campaign, hook, layout), iteration)
    except Exception:  # noqa: BLE001
        logging.getLogger(__name__).exception("goodput of %s not logged", campaign.name)


def register(campaign: Campaign, hook: SlurmHook, layout: Layout, iteration: int,
             evaluation: dict[str, Any] | None, *,
             reused: bool = False) -> dict[str, Any] | None:
    """Register the exported model with lineage tags and the alias ``candidate``.
    ``reused``: the evaluation is the evaluation DAG's, which logs its figures on the
    campaign's run itself.

    The export directory is fetched from the cluster through ``hook`` (SFTP) into a temporary
    directory, only when it still has to be uploaded: Airflow's machines need not see the
    cluster's disk (operators/campaign/adapters/export_fetch.py).
    """
    import hashlib

    from operators.campaign.adapters.export_fetch import ClusterExport
    from operators.tracking.registry import Lineage, register_model

    tracker = open_tracker(campaign)
    if tracker is None:
        return None
    parent = campaign_run(tracker, campaign, hook, layout)
    _log_goodput(tracker, parent, campaign, hook, layout, iteration)
    manifest = read_text(hook, layout.pinned_manifest)
    config = campaign.model_dump_json()
    lineage = Lineage(
        campaign=campaign.name, iteration=iteration,
        dataset_manifest_hash=hashlib.sha256(manifest.encode()).hexdigest() if manifest else None,
        config_hash=hashlib.sha256(config.encode()).hexdigest())
    reg = register_model(tracker.client, f"pretrain-{campaign.name}", parent,
                         ClusterExport(hook, layout.hf_export, iteration), lineage,
                         evaluation=evaluation, campaign_figures=not reused)
    return {"name": reg.name, "version": reg.version, "run_id": reg.run_id,
            "created": reg.created}

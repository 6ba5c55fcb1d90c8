"""The campaign's goodput on its MLflow run, from the segment records beside the checkpoints.

Called once the campaign has trained (adapters/tracking.py ``register``): reads
``segments.jsonl`` (each finished segment's ``segment.json`` with its sacct row and log path,
dag/segment.py) and ``failed_segments.jsonl`` (the segment jobs whose task failed: their
allocation and the work they lost count too, and a hang the watchdog stopped is hang time),
then every segment job's log over the Slurm hook, computes operators/tracking/goodput.py's
figures and logs them at step = the campaign's iteration, with the segments' timeline that
``pretrain-pipeline compare`` draws.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from operators.campaign.adapters.remote import read_history, read_records
from operators.slurm.parse import JobRecord
from operators.tracking import goodput, names

if TYPE_CHECKING:
    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.config import Campaign
    from operators.slurm.hook import SlurmHook
    from operators.tracking.tracker import Tracker

LOG_LIMIT = 256 << 20  # as track_segment reads a segment's log


def _unix(moment: datetime) -> float:
    # Slurm's and the log's times carry no zone; the cluster's clock is taken as UTC.
    return moment.replace(tzinfo=UTC).timestamp() if moment.tzinfo is None \
        else moment.timestamp()


def job_entries(finished: list[dict], failed: list[dict]) -> list[dict]:
    """One entry per segment job: a job recorded twice (a task that re-attached to its failed
    job and failed again) counts once, and a job's finished record wins."""
    entries: dict[str, dict] = {}
    for entry in [*failed, *finished]:
        if entry.get("slurm") and entry.get("log_path"):
            entries[str(entry["slurm"].get("job_id"))] = entry
    return list(entries.values())


def jobs_of(entries: list[dict], read_log: Callable[[str], str],
            nodes: int) -> list[goodput.SegmentJob]:
    """The segment jobs of ``job_entries``' entries, each log read by ``read_log(path)``."""
    return [goodput.segment_job(JobRecord.from_json(entry["slurm"]),
                                read_log(entry["log_path"]).splitlines(), nodes,
                                entry.get("load_seconds"), hung=bool(entry.get("hung")))
            for entry in entries]


def segment_jobs(campaign: Campaign, hook: SlurmHook, layout: Layout) -> list[goodput.SegmentJob]:
    entries = job_entries(read_history(hook, layout),
                          read_records(hook, layout.failed_segments_log))
    return jobs_of(entries, lambda path: hook.read_bytes(path, 0, LOG_LIMIT).decode(
        "utf-8", "replace"), campaign.cluster.nodes)


def log_goodput(tracker: Tracker, run_id: str | None, jobs: list[goodput.SegmentJob],
                iteration: int) -> goodput.Goodput:
    figures = goodput.compute(jobs)
    tracker.log_values(run_id, {names.goodput_metric(k): value
                                for k, value in figures.components().items()}, iteration)
    for step, span in enumerate(goodput.timeline(jobs)):
        tracker.log_values(run_id, {
            names.TIMELINE_SEGMENT: span.segment,
            names.TIMELINE_KIND: goodput.SPAN_KINDS.index(span.kind),
            names.TIMELINE_START: _unix(span.start), names.TIMELINE_END: _unix(span.end)}, step)
    for number, job in goodput.numbered(jobs):
        resumed = job.runs[0].resumed_from if job.runs else None
        if resumed:
            tracker.log_values(run_id, {names.RESUMED_FROM: resumed}, number)
    return figures

"""The campaign's goodput on its MLflow run, from the segment records beside the checkpoints.

Called once the campaign has trained (adapters/tracking.py ``register``): reads
``segments.jsonl`` (each finished segment's ``segment.json`` with its sacct row and log path,
dag/segment.py) and every segment job's log over the Slurm hook, computes
operators/tracking/goodput.py's figures and logs them at step = the campaign's iteration,
with the segments' timeline that ``pretrain-pipeline compare`` draws. Segment jobs whose task
failed are not in ``segments.jsonl``: their allocation is not counted (a requeued job's
earlier runs are, from its log).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from operators.campaign.adapters.remote import read_history
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


def segment_jobs(campaign: Campaign, hook: SlurmHook, layout: Layout) -> list[goodput.SegmentJob]:
    jobs = []
    for entry in read_history(hook, layout):
        if not entry.get("slurm") or not entry.get("log_path"):
            continue
        log = hook.read_bytes(entry["log_path"], 0, LOG_LIMIT).decode("utf-8", "replace")
        jobs.append(goodput.segment_job(JobRecord.from_json(entry["slurm"]), log.splitlines(),
                                        campaign.cluster.nodes, entry.get("load_seconds")))
    return jobs


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
    for number, job in enumerate(goodput.ordered(jobs), 1):
        resumed = job.runs[0].resumed_from if job.runs else None
        if resumed:
            tracker.log_values(run_id, {names.RESUMED_FROM: resumed}, number)
    return figures

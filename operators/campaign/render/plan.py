"""Segment planning, pure: how many segment tasks a DAG run gets, where each one stops, how
long it may train, and whether it moved.

A campaign outlives any Slurm job, so training runs as a chain of segments that each resume
from the last checkpoint. ``train_iters`` stays fixed for the whole campaign (it sizes the
dataset and the learning-rate schedule); a segment ends by time (``exit_duration_in_mins``,
with ``--signal`` as a backup) or, when ``segments.iters_per_segment`` is set, at the next
multiple of it (``exit_interval``: Megatron and the reference trainer both stop when
``iteration % exit_interval == 0``, so targets lie on that grid).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign


class SegmentNoProgress(RuntimeError):
    """A segment ended without advancing the checkpoint: retrying it blindly would loop."""


@dataclass(frozen=True)
class SegmentTarget:
    index: int  # 1-based within this DAG run
    start_iteration: int | None  # where it resumes, if known before the earlier ones ran
    target_iteration: int  # where it stops at the latest (train_iters, or the next multiple)


@dataclass(frozen=True)
class Plan:
    train_iters: int
    start_iteration: int
    segments: tuple[SegmentTarget, ...]

    @property
    def done(self) -> bool:
        return self.start_iteration >= self.train_iters


def next_target(campaign: Campaign, iteration: int | None) -> int:
    """The iteration a segment starting at ``iteration`` stops at, at the latest."""
    iteration, total = iteration or 0, campaign.training.train_iters
    per = campaign.segments.iters_per_segment
    if per is None or iteration >= total:
        return total
    return min(total, (iteration // per + 1) * per)


def plan_segments(campaign: Campaign, iteration: int | None = 0) -> Plan:
    """The segment tasks of one DAG run, given the checkpoint iteration it starts from.

    With ``iters_per_segment``, one task per grid step left (at most ``max_per_run``).
    Without it how far a segment gets depends on its speed, so every task aims at
    ``train_iters``, there are ``max_per_run`` of them, and the ones after the campaign is
    done skip. None when the campaign is already done.
    """
    start, total = iteration or 0, campaign.training.train_iters
    cap, per = campaign.segments.max_per_run, campaign.segments.iters_per_segment
    segments: list[SegmentTarget] = []
    if start < total and per is None:
        segments = [SegmentTarget(i, start if i == 1 else None, total) for i in range(1, cap + 1)]
    position = start
    while per is not None and position < total and len(segments) < cap:
        target = next_target(campaign, position)
        segments.append(SegmentTarget(len(segments) + 1, position, target))
        position = target
    return Plan(train_iters=total, start_iteration=start, segments=tuple(segments))


def check_progress(before: int | None, after: int | None) -> int:
    """Iterations a segment advanced; raises :class:`SegmentNoProgress` if none."""
    before, after = before or 0, after or 0
    if after < before:
        raise SegmentNoProgress(f"segment went backwards: iteration {before} -> {after} "
                                "(checkpoint lost or a different checkpoint directory?)")
    if after == before:
        raise SegmentNoProgress(f"segment made no progress (iteration stayed at {before})")
    return after - before


def save_seconds_estimate(results: Iterable[Mapping], default_s: float) -> float:
    """Seconds one save takes: the slowest per-save time measured by earlier segments'
    ``segment.json`` (save_seconds / saves), else ``default_s``. The slowest, because a
    save cut by the time limit loses the whole segment."""
    measured = [r["save_seconds"] / r["saves"] for r in results
                if r.get("saves") and r.get("save_seconds") is not None]
    return max(measured, default=default_s)


def startup_minutes_estimate(results: Iterable[Mapping], default_min: float) -> float:
    """Minutes from job start to the trainer's exit timer: the slowest ``startup_seconds``
    earlier segments measured, else ``default_min``. Only that part: Bridge's timer starts
    inside ``pretrain()``, so model set-up and checkpoint loading already count against
    ``exit_duration_in_mins`` and must not be subtracted a second time."""
    measured = [r["startup_seconds"] / 60.0 for r in results
                if isinstance(r.get("startup_seconds"), (int, float))
                and not isinstance(r.get("startup_seconds"), bool)
                and math.isfinite(r["startup_seconds"]) and r["startup_seconds"] >= 0]
    return max(measured, default=default_min)


def exit_duration_minutes(time_limit_min: float, startup_estimate_min: float,
                          measured_save_s: float, margin_min: float) -> int:
    """``train.exit_duration_in_mins`` for a segment: whole minutes of training that leave
    room, inside the job's time limit, for start-up before the training timer starts, one
    final save, and a margin (the timer is checked once per iteration, so one iteration can
    overrun it). Megatron takes an int; rounding down errs on the side of saving."""
    for name, value in (("time_limit_min", time_limit_min),
                        ("startup_estimate_min", startup_estimate_min),
                        ("measured_save_s", measured_save_s), ("margin_min", margin_min)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0 (got {value!r})")
    minutes = math.floor(time_limit_min - startup_estimate_min - measured_save_s / 60.0
                         - margin_min)
    if minutes < 1:
        raise ValueError(
            f"a {time_limit_min} min segment leaves no training time after start-up "
            f"{startup_estimate_min} min + save {measured_save_s:.0f} s + margin {margin_min} min")
    return minutes


def signal_lead_seconds(margin_min: float) -> int:
    """``--signal=TERM@N``: half the margin before the limit. The planned exit has saved by
    then; the signal is only a backup, and Slurm may send it up to 60 s early."""
    return max(60, int(margin_min * 60) // 2)


def segment_job_options(campaign: Campaign, *, batch_shell: bool) -> dict:
    """sbatch options every training segment has, whoever trains it.

    ``--signal`` as the backup stop (``B:`` when the trainer is the batch shell itself).
    ``--requeue``: a segment resumes from its last checkpoint, so Slurm may restart it
    under the same job id after a node failure, a preemption or ``scontrol requeue``.
    """
    lead = signal_lead_seconds(campaign.segments.margin_min)
    return {"signal": f"{'B:' if batch_shell else ''}TERM@{lead}", "requeue": True}


def segment_exit_minutes(campaign: Campaign, earlier_results: Iterable[Mapping] = ()) -> int:
    """:func:`exit_duration_minutes` with the start-up and save times earlier segments
    measured, else the campaign's estimates."""
    s, results = campaign.segments, list(earlier_results)
    return exit_duration_minutes(campaign.cluster.time_limit_minutes,
                                 startup_minutes_estimate(results, s.startup_estimate_min),
                                 save_seconds_estimate(results, s.save_estimate_s),
                                 s.margin_min)

"""The log-stream watchers of a campaign's training segment (docs/log-watch.md): the hang
watchdog, from the campaign's settings and what earlier segments measured. Issue 19's
loss-spike watcher is added here too, as one more :class:`WatchSpec`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from operators.campaign.render.plan import save_seconds_estimate, startup_minutes_estimate
from operators.slurm.watch import WatchSpec
from operators.tracking.hang import HangWatch

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

STARTUP_FACTOR = 2.0  # the estimate stops at the trainer's exit timer; set-up and load follow
STARTUP_FLOOR_S = 60.0  # a measured fast start must not make the watchdog trigger-happy
GRACE_FLOOR_S = 20.0


def startup_allowance_s(campaign: Campaign, history: Iterable[Mapping]) -> float:
    """Seconds a segment may take to its first step (and the floor of the auto timeout)."""
    minutes = startup_minutes_estimate(list(history), campaign.segments.startup_estimate_min)
    return max(STARTUP_FLOOR_S, STARTUP_FACTOR * minutes * 60.0)


def stop_grace_s(campaign: Campaign, history: Iterable[Mapping]) -> float:
    """SIGTERM -> scancel: time for two saves (the trainer saves when signalled)."""
    return max(GRACE_FLOOR_S, 2.0 * save_seconds_estimate(list(history),
                                                          campaign.segments.save_estimate_s))


def segment_watchers(campaign: Campaign, history: list[dict],
                     start_iteration: int | None) -> tuple[WatchSpec, ...]:
    """The watchers of the segment that resumes at ``start_iteration`` after ``history``
    (earlier segment.json's)."""
    set_min = campaign.segments.hang_timeout_min
    return (HangWatch.spec(startup_allowance_s(campaign, history),
                           None if set_min == "auto" else float(set_min) * 60.0,
                           stop_grace_s(campaign, history), start_iteration),)

"""Segment planning: task counts, targets on the exit-interval grid, done, progress."""

from __future__ import annotations

import pytest

from operators.campaign.render.plan import (
    SegmentNoProgress,
    check_progress,
    next_target,
    plan_segments,
    save_seconds_estimate,
    segment_end,
    segment_exit_minutes,
)
from operators.campaign.schema.load import campaign_from_dict
from tests.campaign.util import DEMO, LLAMA_8B, edited, raw


def _campaign(base=DEMO, **changes):
    return campaign_from_dict(edited(raw(base), changes))


@pytest.mark.parametrize(("iteration", "expected"), [
    (0, [(1, 0, 20), (2, 20, 40), (3, 40, 60)]),  # the demo: 60 iters, 20 per segment
    (None, [(1, 0, 20), (2, 20, 40), (3, 40, 60)]),  # no checkpoint yet
    (25, [(1, 25, 40), (2, 40, 60)]),  # a segment cut by time lands off the grid
    (40, [(1, 40, 60)]),
    (59, [(1, 59, 60)]),
])
def test_grid_targets(iteration, expected) -> None:
    plan = plan_segments(_campaign(), iteration)
    assert [(s.index, s.start_iteration, s.target_iteration) for s in plan.segments] == expected
    assert not plan.done


def test_cap_limits_tasks_per_run() -> None:
    plan = plan_segments(_campaign(**{"segments.max_per_run": 2}), 0)
    assert [s.target_iteration for s in plan.segments] == [20, 40]


def test_off_grid_train_iters_ends_at_train_iters() -> None:
    c = _campaign(**{"training.train_iters": 50})
    assert [s.target_iteration for s in plan_segments(c, 0).segments] == [20, 40, 50]
    assert next_target(c, 45) == 50


@pytest.mark.parametrize("iteration", [60, 61, 1000])
def test_done_plans_no_segments(iteration) -> None:
    plan = plan_segments(_campaign(), iteration)
    assert plan.done and plan.segments == ()


def test_time_cut_segments_all_aim_at_train_iters() -> None:
    c = campaign_from_dict(raw(LLAMA_8B))  # no iters_per_segment: 6 tasks, each to 1000
    plan = plan_segments(c, 250)
    assert [(s.index, s.target_iteration) for s in plan.segments] == [(i, 1000)
                                                                      for i in range(1, 7)]
    assert plan.segments[0].start_iteration == 250
    assert all(s.start_iteration is None for s in plan.segments[1:])  # known only at run time
    assert not plan_segments(c, 999).done and plan_segments(c, 1000).done


def test_progress() -> None:
    assert check_progress(0, 20) == 20
    assert check_progress(None, 5) == 5
    with pytest.raises(SegmentNoProgress, match=r"segment made no progress \(iteration stayed "
                                                r"at 40\)"):
        check_progress(40, 40)
    with pytest.raises(SegmentNoProgress, match="stayed at 0"):
        check_progress(None, None)
    with pytest.raises(SegmentNoProgress, match="backwards: iteration 40 -> 20"):
        check_progress(40, 20)


def test_a_segments_end_is_its_own_last_save_when_a_later_job_moved_the_tracker() -> None:
    # Segment 1 saved 40; its pre-queued successor trained on to 60 before Airflow read it.
    end = segment_end(40, 60)
    assert end.iteration == 40 and "later segment" in end.note and "60" in end.note
    # A stale figure (no save of this job survived): the tracker, where a resume starts.
    end = segment_end(60, 40)
    assert end.iteration == 40 and "segment.json says iteration 60" in end.note
    assert segment_end(40, 40) == segment_end(None, 40) == segment_end(True, 40)
    assert segment_end(None, 40).iteration == 40 and segment_end(40, 40).note is None


def test_save_estimate_takes_the_slowest_measured_save() -> None:
    results = [{"save_seconds": 100.0, "saves": 4}, {"save_seconds": 90.0, "saves": 2},
               {"save_seconds": 0.0, "saves": 0}, {"stop_reason": "failed"}]
    assert save_seconds_estimate(results, 120.0) == 45.0
    assert save_seconds_estimate([], 120.0) == 120.0


def test_segment_exit_minutes_uses_measurements() -> None:
    c = campaign_from_dict(raw(LLAMA_8B))
    assert segment_exit_minutes(c) == 230  # 240 - 3 - 120 s - 5
    assert segment_exit_minutes(c, [{"save_seconds": 300.0, "saves": 1}]) == 227
    # The start-up before the trainer's timer, measured, replaces the estimate: the slowest.
    assert segment_exit_minutes(c, [{"startup_seconds": 60.0},
                                    {"startup_seconds": 30.0}]) == 232

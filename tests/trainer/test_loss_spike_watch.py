"""The loss-spike watcher (operators/tracking/health.py) on the reference trainer's real log,
with the test-only faults of jobscripts/trainer_faults.py: fed through the trigger's log-watch
extension point (operators/slurm/watch.py's LogWatch), as the triggerer feeds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobscripts.job_files import REFERENCE_FAULTS
from operators.slurm.watch import LogWatch, Tick
from operators.tracking.health import (
    NAN_STEPS,
    SPIKE,
    LossSpikeWatch,
    baseline_losses,
    is_spike,
    losses_of,
)
from tests.support.trainer import losses, run_trainer

# Global batch 8: iteration 9 trains samples 64-71.
SPIKE_AT = 9


def _watch(lines: list[str], *, split: int | None = None, **params) -> LogWatch:
    """The watcher as the trigger runs it; with ``split``, re-created from its serialised
    kwargs halfway (a triggerer restart)."""
    spec = LossSpikeWatch.spec(**{"factor": 3.0, "window": 4, "nan_steps": True,
                                  "stop_running": False, "grace_s": 30.0, **params})
    watch = LogWatch((spec,))
    for part in ([lines] if split is None else [lines[:split], lines[split:]]):
        watch.feed(part)
        watch.tick(Tick(1000.0, True))
        watch = LogWatch.from_json(json.loads(json.dumps(watch.to_json())))
    return watch


def _faulted(tmp_path: Path, config_for, faults: dict):
    config = config_for(tmp_path)
    Path(config["save"]).mkdir(parents=True)
    (Path(config["save"]) / REFERENCE_FAULTS).write_text(json.dumps(faults))
    run = run_trainer(tmp_path, config)
    assert run.rc == 0, run.log
    return run


def test_a_spike_in_the_data_is_flagged_at_its_iteration(tmp_path, config_for, uncut) -> None:
    run = _faulted(tmp_path, config_for, {"loss_spike": {"from_sample": 64, "samples": 8,
                                                         "factor": 8.0}})
    lines = run.log.splitlines()
    for watch in (_watch(lines), _watch(lines, split=len(lines) * 2 // 3)):
        (finding,) = watch.findings
        assert finding.code == SPIKE and finding.iteration == SPIKE_AT, finding
        assert not finding.stop_job and not finding.retryable
        assert "stops before its next segment" in finding.reason
        around = dict(losses_of(finding.detail))
        assert around[SPIKE_AT] == pytest.approx(losses(run.log)[SPIKE_AT])
        assert set(around) >= {SPIKE_AT - 3, SPIKE_AT - 1}  # the losses before it, for the form
    assert not _watch(uncut.log.splitlines()).findings  # the same run without the fault


def test_nan_steps_are_flagged_and_can_stop_the_running_segment(tmp_path, config_for) -> None:
    run = _faulted(tmp_path, config_for, {"nan": {"from_sample": 64, "samples": 1}})
    watch = _watch(run.log.splitlines(), stop_running=True)
    (finding,) = watch.findings
    assert finding.code == NAN_STEPS and finding.iteration == SPIKE_AT
    assert finding.stop_job and "nan iterations" in finding.reason
    assert watch.stopping is finding
    assert not _watch(run.log.splitlines(), nan_steps=False).findings


def test_a_spike_in_a_segments_first_iterations_is_judged_on_the_campaigns_losses(
        tmp_path, config_for) -> None:
    """A segment's watcher starts from the losses of the segments before it: a spike at a
    segment's first iteration (the story under the real scheduler: segments of 2 iterations,
    window 3) was never flagged, its watcher having no baseline yet."""
    run = _faulted(tmp_path, config_for, {"loss_spike": {"from_sample": 64, "samples": 8,
                                                         "factor": 8.0}})
    lines = run.log.splitlines()
    first = next(i for i, line in enumerate(lines) if f"iteration {SPIKE_AT:>8}/" in line)
    before, segment = lines[:first], lines[first:]  # the spike is this segment's first step
    assert not _watch(segment).findings  # no baseline: the spike goes by
    baseline = baseline_losses(before, SPIKE_AT - 1, 4)
    assert [it for it, _ in baseline] == list(range(SPIKE_AT - 4, SPIKE_AT))
    assert dict(baseline) == pytest.approx({it: losses(run.log)[it] for it, _ in baseline})
    (finding,) = _watch(segment, baseline=baseline).findings
    assert finding.code == SPIKE and finding.iteration == SPIKE_AT
    # After a rollback to iteration 6, the iterations trained past it are no baseline.
    assert [it for it, _ in baseline_losses(lines, 6, 4)] == [3, 4, 5, 6]
    assert baseline_losses(lines, 0, 4) == []


@pytest.mark.pure
def test_spike_rule_needs_a_full_window_and_a_factor_above_one() -> None:
    assert is_spike(10.0, [2.0, 2.0, 2.0], 3.0, 4) is None  # no baseline yet
    assert is_spike(10.0, [2.0, 9.0, 2.0, 2.0], 3.0, 4) == 2.0
    assert is_spike(6.0, [2.0, 2.0, 2.0, 2.0], 3.0, 4) is None  # not above 3 x 2
    with pytest.raises(ValueError, match="factor"):
        LossSpikeWatch({"factor": 1.0, "window": 4}, {})

"""The hang watchdog's rule and watcher (operators/tracking/hang.py) and the log-watch mechanics
it runs on (operators/slurm/watch.py): real log lines, a given clock. Pure.

The lines are jobscripts/megatron_log.py's, the formats the reference trainer prints and
Megatron Bridge's training_log prints byte for byte (tests/trainer/test_bridge_log.py).
"""

from __future__ import annotations

import pytest

from jobscripts import megatron_log as ml
from operators.slurm.messages import TERMINAL, JobEvent
from operators.slurm.trigger import SlurmJobTrigger
from operators.slurm.watch import (
    LogWatch,
    LogWatcher,
    StopStep,
    Tick,
    WatchSpec,
    WatchSpecError,
    failure_reason,
)
from operators.tracking.hang import FACTOR, HangWatch, hang_timeout

T0 = 1_790_000_000.0  # wall clock, epoch seconds


def _iteration(i: int, elapsed_ms: float = 200.0) -> str:
    return ml.iteration_line(i, 30, i * 8, elapsed_ms, 1e-3, 8, 5.2, 1.1, 0, 0)


def _watch(**params) -> LogWatch:
    spec = HangWatch.spec(startup_s=params.pop("startup_s", 60.0),
                          timeout_s=params.pop("timeout_s", None),
                          grace_s=params.pop("grace_s", 20.0),
                          start_iteration=params.pop("start_iteration", 0))
    return LogWatch((spec,))


def _run(watch: LogWatch, now: float, lines=(), running: bool = True) -> list[StopStep]:
    watch.feed(lines)
    return watch.tick(Tick(now, running))


# -- the default timeout rule -----------------------------------------------------------------
def test_before_the_first_step_the_start_up_allowance_holds() -> None:
    assert hang_timeout([], 600.0, None, first_step_seen=False).seconds == 600.0
    # a set timeout longer than the allowance wins, a shorter one does not apply yet
    assert hang_timeout([], 600.0, 900.0, first_step_seen=False).seconds == 900.0
    assert hang_timeout([], 600.0, 30.0, first_step_seen=False).seconds == 600.0


def test_auto_is_ten_median_steps_never_below_the_start_up_estimate() -> None:
    steps = [2.0, 2.2, 50.0, 2.1, 1.9]  # one slow interval (a save) does not move the median
    timeout = hang_timeout(steps, 5.0, None, first_step_seen=True)
    assert timeout.seconds == pytest.approx(FACTOR * 2.1) and "median" in timeout.how
    assert hang_timeout(steps, 120.0, None, first_step_seen=True).seconds == 120.0
    assert hang_timeout([], 120.0, None, first_step_seen=True).seconds == 120.0


def test_a_set_timeout_applies_after_the_first_step() -> None:
    timeout = hang_timeout([2.0], 600.0, 30.0, first_step_seen=True)
    assert (timeout.seconds, timeout.how) == (30.0, "segments.hang_timeout_min")


def test_step_time_is_read_from_the_lines_not_the_clock() -> None:
    # log_interval 5: one line per 5 iterations of 0.4 s -> 2 s per logged interval, even though
    # the lines reach the watcher in one burst (a triggerer catching up after a restart).
    watch = HangWatch({"startup_s": 1.0, "start_iteration": 10}, {})
    lines = [ml.throughput_line(0.4, 0.01), _iteration(15, 400.0), _iteration(20, 400.0),
             _iteration(25, 400.0)]
    watch.lines(lines, Tick(T0, True))
    assert watch.step_s == pytest.approx([2.0, 2.0, 2.0])
    assert watch.timeout().seconds == pytest.approx(20.0)


# -- the watcher through LogWatch ---------------------------------------------------------------
def test_a_stalled_log_is_stopped_sigterm_first_then_cancelled() -> None:
    watch = _watch(timeout_s=30.0, grace_s=20.0, start_iteration=4)
    assert _run(watch, T0, [ml.loaded_line("/c/iter_0000004", 4)]) == []
    assert _run(watch, T0 + 10, [_iteration(5), _iteration(6),
                                 ml.saved_line(6, "/c")]) == []
    assert _run(watch, T0 + 40) == []  # 30 s since the last progress: not more
    assert _run(watch, T0 + 41) == [StopStep.SIGNAL]
    finding = watch.stopping
    assert finding.reason.startswith("no progress for 0.5 min at iteration 6 ")
    assert (finding.code, finding.iteration, finding.stop_job) == ("hang", 6, True)
    assert finding.detail == {"waited_s": 31.0, "timeout_s": 30.0, "last_progress_at": T0 + 10}
    assert _run(watch, T0 + 45) == [StopStep.SIGNAL]  # not done: asked again
    watch.done(StopStep.SIGNAL, T0 + 45)
    assert _run(watch, T0 + 60) == []
    assert _run(watch, T0 + 65) == [StopStep.CANCEL]
    watch.done(StopStep.CANCEL, T0 + 65)
    assert _run(watch, T0 + 100) == [] and len(watch.findings) == 1


def _at(line: str, epoch: float) -> str:
    """``line`` with Bridge's wall clock set to ``epoch`` (whole seconds, local time)."""
    from datetime import datetime

    stamp = datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")
    return f" [{stamp}]" + line[line.index("]") + 1:]


def test_progress_counts_from_the_lines_own_clock_held_between_two_reads() -> None:
    """Iteration 6 printed at T0 + 2 and read at T0 + 5 (the previous read at T0): the hang
    is found 30 s after T0 + 3 (its second's end), not 30 s after the read."""
    watch = _watch(timeout_s=30.0, start_iteration=4)
    assert _run(watch, T0, [_at(_iteration(5), T0 - 1)]) == []  # first read: no bound yet
    assert _run(watch, T0 + 5, [_at(_iteration(6), T0 + 2)]) == []
    assert _run(watch, T0 + 33) == []
    assert _run(watch, T0 + 34) == [StopStep.SIGNAL]
    assert watch.stopping.detail["last_progress_at"] == T0 + 3


@pytest.mark.parametrize("skew_s", [-7200.0, 7200.0])
def test_a_node_clock_unlike_the_triggerers_moves_progress_by_one_read_at_most(skew_s) -> None:
    """A node two hours off (another time zone): its lines count from between the two reads."""
    watch = _watch(timeout_s=30.0, start_iteration=4)
    assert _run(watch, T0, [_at(_iteration(5), T0 + skew_s)]) == []
    assert _run(watch, T0 + 5, [_at(_iteration(6), T0 + 4 + skew_s)]) == []
    counted_from = T0 if skew_s < 0 else T0 + 5  # the previous read, or this one
    assert _run(watch, counted_from + 30) == []
    assert _run(watch, counted_from + 31) == [StopStep.SIGNAL]
    assert watch.stopping.detail["last_progress_at"] == counted_from


def test_a_queued_or_requeued_job_is_not_hung() -> None:
    watch = _watch(timeout_s=30.0, startup_s=60.0)
    assert _run(watch, T0, running=False) == []
    assert _run(watch, T0 + 3600, running=False) == []  # an hour in the queue
    assert _run(watch, T0 + 3601) == []  # starts: the start-up allowance from now
    assert _run(watch, T0 + 3650, [_iteration(1)]) == []
    assert _run(watch, T0 + 3700, running=False) == []  # requeued
    assert _run(watch, T0 + 4000) == []  # running again: the clock starts again
    assert _run(watch, T0 + 4061) == [StopStep.SIGNAL]
    assert "at iteration 1" in watch.stopping.reason


def test_no_step_at_all_is_a_hang_after_the_start_up_allowance() -> None:
    watch = _watch(startup_s=120.0, start_iteration=25)
    assert _run(watch, T0, ["loading the dataset..."]) == []
    assert _run(watch, T0 + 120) == []
    assert _run(watch, T0 + 121) == [StopStep.SIGNAL]
    assert watch.stopping.reason.startswith(
        "no progress for 2.0 min at iteration 25 before its first step")


def test_steady_training_is_never_stopped() -> None:
    watch = _watch(startup_s=5.0)  # auto: 10 x 0.2 s, floor 5 s
    for i in range(1, 200):
        assert _run(watch, T0 + i * 0.2, [_iteration(i)]) == []
    assert watch.findings == []


# -- the extension point -------------------------------------------------------------------------
class EveryLine(LogWatcher):
    """A watcher written against the public interface alone: counts lines in its state, and
    ends the wait (without stopping the job) at the line "STOP"."""

    def __init__(self, params, state) -> None:
        super().__init__(params, state)
        self.seen = int(state.get("seen", 0))

    def lines(self, lines, tick):
        self.seen += len(lines)
        if "STOP" in lines:
            yield self.finding("stop_line", f"saw STOP after {self.seen} lines", tick,
                               end_wait=True)

    def state(self):
        return {"seen": self.seen}


def test_watchers_and_their_state_survive_the_triggers_kwargs() -> None:
    watch = LogWatch((_watch(timeout_s=30.0).specs[0],
                      WatchSpec(f"{__name__}.EveryLine", {})))
    _run(watch, T0, ["a", "b", _iteration(1)])
    trigger = SlurmJobTrigger("slurm_local", "7", log_path="/runs/k/slurm-7.out",
                              watch=watch.to_json())
    path, kwargs = trigger.serialize()
    assert path == "operators.slurm.trigger.SlurmJobTrigger"
    again = SlurmJobTrigger(**kwargs)
    assert [s.kind for s in again.watch.specs] == ["operators.tracking.hang.HangWatch",
                                                    f"{__name__}.EveryLine"]
    assert again.watch.specs[1].state == {"seen": 3}
    again.watch.feed(["STOP"])
    assert again.watch.tick(Tick(T0 + 1, True)) == []  # ends the wait, stops nothing
    assert again.watch.ends_wait and again.watch.stopping is None
    assert failure_reason(again.watch.findings) == "saw STOP after 4 lines"


def test_findings_travel_typed_in_the_event() -> None:
    watch = _watch(timeout_s=1.0)
    _run(watch, T0, [_iteration(3)])
    _run(watch, T0 + 2)
    event = JobEvent.from_json(JobEvent(TERMINAL, "7", findings=tuple(watch.findings))
                               .to_json())
    assert event.findings == tuple(watch.findings)
    assert failure_reason(event.findings).startswith("no progress for 0.0 min at iteration 3")
    assert "findings" not in JobEvent(TERMINAL, "7").to_json()


@pytest.mark.parametrize(("spec", "says"), [
    (WatchSpec("operators.nowhere.Watcher"), "cannot import it"),
    (WatchSpec("operators.slurm.watch.Tick"), "is not a LogWatcher subclass"),
    (WatchSpec("operators.tracking.hang.HangWatch", {}), "bad parameters"),
    (WatchSpec("operators.tracking.hang.HangWatch", {"startup_s": 1, "timeout_s": 0}),
     "bad parameters"),
])
def test_a_bad_watcher_spec_is_refused_naming_it(spec, says) -> None:
    with pytest.raises(WatchSpecError, match=says) as raised:
        LogWatch((spec,))
    assert spec.kind in str(raised.value)

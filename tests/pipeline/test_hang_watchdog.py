"""The hang watchdog under a real ``airflow standalone`` (its triggerer) on the local cluster.

The reference trainer hangs after iteration 6 (the test-only fault, jobscripts/
trainer_faults.py) in two campaigns (tests/dags/hang_watchdog.py, hang timeout 12 s): in one the
hang ends at SIGTERM (the trainer saves iteration 6 and exits), in the other it ignores SIGTERM
and only the cancel after the grace period ends it (the last checkpoint is iteration 4). Each
segment task's first try must fail with "no progress for ... at iteration 6", found through the
trigger's log stream; its retry must resume from the checkpoint and train to the end.

The detection time (hang start -> SIGTERM) is measured, not asserted (no timed assertions):
it is printed and written to $PP_HANG_FIGURES when set.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime
from pathlib import Path

import pytest

from operators.campaign.adapters.goodput_log import job_entries, jobs_of
from operators.campaign.render.layout import Layout
from operators.slurm.trigger import WATCH_LOG_MARK
from operators.tracking import goodput
from tests.dags.hang_watchdog import CAMPAIGNS, HANG_TIMEOUT_MIN, PREFIX, TRAIN_ITERS
from tests.support import cluster
from tests.support.trainer import lay_out_segment_campaigns

pytestmark = [pytest.mark.cluster, pytest.mark.airflow]

HANG_AT = 6
LAST_SAVE_BEFORE = 4  # save_interval 4
TASK = "segment_1"


def _lay_out() -> None:
    lay_out_segment_campaigns(Path(PREFIX), [
        (campaign, {"hang": {"at_iteration": HANG_AT, "signals": name.endswith("_term")}})
        for name, campaign in CAMPAIGNS.items()])


def _finding(log: str) -> dict:
    lines = [line for line in log.splitlines() if WATCH_LOG_MARK in line]
    assert len(lines) == 1, log[-4000:]
    return json.loads(lines[0].split(WATCH_LOG_MARK, 1)[1])


def _records(path: str) -> list[dict]:
    file = Path(path)
    return [json.loads(x) for x in file.read_text().splitlines() if x.strip()] \
        if file.exists() else []


def _hang_started(job_log: str) -> float:
    """When the trainer logged iteration HANG_AT (Bridge's timestamp on the line, local time):
    the hang starts right after it."""
    match = re.search(rf"\[(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d)\] iteration\s+{HANG_AT}/", job_log)
    assert match, job_log[-2000:]
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").timestamp()


@pytest.fixture(scope="module")
def runs(standalone):
    _lay_out()
    started = time.monotonic()
    ids = {name: standalone.trigger(name) for name in CAMPAIGNS}
    states = {name: standalone.wait_run(name, run_id, timeout=600)
              for name, run_id in ids.items()}
    return ids, states, time.monotonic() - started


@pytest.mark.parametrize("name", sorted(CAMPAIGNS))
def test_a_hang_is_stopped_and_the_retry_resumes_from_the_checkpoint(standalone, runs,
                                                                      name) -> None:
    af, (ids, states, took) = standalone, runs
    run_id = ids[name]
    ti = af.task_instance(name, run_id, TASK)
    first = af.task_log(name, run_id, TASK, try_number=1)
    assert (states[name], ti["state"], ti["try_number"]) == ("success", "success", 2), first
    # try 1: the trigger's log watch found the hang, stopped the job, and failed the task
    finding = _finding(first)
    assert finding["code"] == "hang" and finding["iteration"] == HANG_AT
    assert re.search(rf"no progress for \d+\.\d min at iteration {HANG_AT} ", first), first
    assert finding["detail"]["timeout_s"] == pytest.approx(HANG_TIMEOUT_MIN * 60)
    assert "SIGTERM sent" in first
    # try 1's job: the one whose log hung (every try of the key shares its run dir)
    job_id = re.search(r"Slurm job (\d+): SIGTERM sent", first).group(1)
    run_dir = re.search(r"submitted Slurm job \d+ \(key \S+, run dir (\S+)\)", first).group(1)
    job_log = Path(run_dir, f"slurm-{job_id}.out").read_text()
    assert f"TEST FAULT: hanging after iteration {HANG_AT}" in job_log
    state = cluster.sacct_job(job_id)["state"]
    layout = Layout.for_campaign(CAMPAIGNS[name])
    if name.endswith("_term"):
        # the trainer honoured SIGTERM at the hang: it saved iteration 6 and exited
        assert "cancelled (log watch" not in first
        resumed_from = HANG_AT
    else:
        # SIGTERM ignored: cancelled after the grace period; the last save was before the hang
        assert f"Slurm job {job_id}: cancelled (log watch" in first
        assert state.startswith("CANCELLED"), state  # "CANCELLED by <uid>"
        resumed_from = LAST_SAVE_BEFORE
    # try 2: a new job, resumed from that checkpoint, trained to the end
    second = af.task_log(name, run_id, TASK, try_number=2)
    assert f"earlier job {job_id} for key" in second, second[-3000:]
    assert re.search(rf"successfully loaded checkpoint from \S+ .*at iteration {resumed_from}\b",
                     second), second[-3000:]
    tracker = Path(layout.checkpoints, "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == str(TRAIN_ITERS)
    # goodput counts the hung job: its allocation, its hang (from its last step line to its
    # end) and the iterations its retry trained again
    failed = _records(layout.failed_segments_log)
    assert [(e["slurm"]["job_id"], e["hung"], e["segment"]) for e in failed] == [
        (job_id, True, 1)]
    jobs = jobs_of(job_entries(_records(layout.segments_log), failed),
                   lambda path: Path(path).read_text(errors="replace"), 1)
    figures = goodput.compute(jobs)
    ended = cluster.sacct_field(job_id, "End")
    assert figures.segments == 2 and figures.iterations_redone == HANG_AT - resumed_from
    assert figures.hang_s == pytest.approx(
        (datetime.fromisoformat(ended) - datetime.fromtimestamp(_hang_started(job_log)))
        .total_seconds(), abs=1.0)
    detect_s = finding["at"] - _hang_started(job_log)
    figures = {"campaign": name, "hang_detect_s": round(detect_s, 1),
               "hang_timeout_s": finding["detail"]["timeout_s"],
               "waited_s": finding["detail"]["waited_s"], "poll_interval_s": 5.0,
               "both_runs_s": round(took, 1)}
    print(json.dumps(figures))
    if os.environ.get("PP_HANG_FIGURES"):
        with open(os.environ["PP_HANG_FIGURES"], "a") as out:
            out.write(json.dumps(figures) + "\n")

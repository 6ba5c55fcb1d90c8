"""Goodput from segment records as the real tools print them.

tests/tracking/goodput_run/ was recorded on the local cluster from a run of
tests/pipeline/test_campaign_faults.py (campaign ci_tracked, 2026-12-01): ``sacct.txt`` is
``sacct --parsable2 --noheader --duplicates --format=<SACCT_FIELDS>`` for its three segment
jobs, ``slurm-*.out`` their logs (the reference trainer; job 249 was requeued by ``scontrol
requeue`` mid-run, so its log holds two runs) and ``segments.jsonl`` the segment records the
segment operator left beside the checkpoints. The lost-work case is built from
jobscripts/megatron_log.py, the reference trainer's own printers of Megatron Bridge's lines.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest

from jobscripts import megatron_log as ml
from operators.slurm.parse import SACCT_FIELDS, JobRecord, read_sacct
from operators.tracking import goodput

RUN = Path(__file__).parent / "goodput_run"


def _recorded() -> list[goodput.SegmentJob]:
    rows = read_sacct((RUN / "sacct.txt").read_text()).records
    jobs = []
    for line in (RUN / "segments.jsonl").read_text().splitlines():
        entry = json.loads(line)
        log = (RUN / Path(entry["log_path"]).name).read_text().splitlines()
        jobs.append(goodput.segment_job(rows[entry["slurm"]["job_id"]], log, 1,
                                        entry.get("load_seconds")))
    return jobs


def test_recorded_campaign_accounts_for_every_second_of_its_jobs() -> None:
    jobs = _recorded()
    figures = goodput.compute(jobs)
    assert (figures.segments, figures.runs) == (3, 4)  # job 249 ran twice (requeued)
    # sacct: 246 ran 26 s, 247 23 s, 249 21 s before the requeue (its restart-0 line to the
    # cancel line) and 20 s after it.
    assert figures.allocated_node_s == 26 + 23 + 21 + 20
    assert figures.iterations_trained == 30 and figures.iterations_redone == 0
    assert figures.redone_s == 0
    # every iteration line's "elapsed time per iteration (ms)", once each
    elapsed = [float(x.split("elapsed time per iteration (ms): ")[1].split(" ")[0])
               for name in ("slurm-246.out", "slurm-247.out", "slurm-249.out")
               for x in (RUN / name).read_text().splitlines() if "elapsed time per" in x]
    assert len(elapsed) == 30
    assert figures.train_s == pytest.approx(sum(elapsed) / 1000)
    assert figures.goodput_in_jobs == pytest.approx(figures.train_s / 90)
    # The campaign's node time: 246's Start (12:28:22) to 249's End (12:31:26), the 90 s the
    # jobs held plus the gaps between them (33 + 44 s) and 249's wait for its restart (17 s).
    assert figures.span_node_s == 184 == 90 + 33 + 44 + 17
    assert figures.goodput == pytest.approx(figures.train_s / 184)
    # queue: 247 waited 1 s (Submit 12:29:20, Start 12:29:21); 249's requeued run waited
    # from the cancel (12:30:49) to its restart (12:31:06); 249's own first wait is lost
    # (the requeue set Submit anew), 246 started at once.
    assert figures.queue_s == 1 + 17
    # gaps: 246 End 12:28:48 -> 247 Start 12:29:21; 247 End 12:29:44 -> 249 Start 12:30:28
    assert figures.gap_s == 33 + 44 and figures.gap_median_s == 38.5
    # save-checkpoint timer lines: 246 (two saves), 247 (two), 249 (one, then two)
    assert figures.save_s == pytest.approx((278.53 + 83.89 + 121.38 + 30.22 + 115.37 + 145.38
                                            + 23.06) / 1000, abs=1e-3)
    # start-up: each run's first step began 15-19 s after its start (imports, model build)
    for job in jobs:
        for run in job.runs:
            assert 10 < (run.first_step_at - run.start).total_seconds() < 25
    assert figures.startup_s > 60
    assert figures.hang_s == 0
    assert [r.resumed_from for j in jobs for r in j.runs] == [None, 10, 20, 22]


def _sacct_row(job: int, state: str, submit: str, start: str, end: str) -> str:
    values = {"JobID": str(job), "JobIDRaw": str(job), "JobName": f"pp-train.segment-{job}",
              "State": state, "ExitCode": "0:0" if state == "COMPLETED" else "1:0",
              "Submit": submit, "Start": start, "End": end, "ElapsedRaw": "0",
              "NodeList": "vm[1-2]", "AllocTRES": "billing=2,cpu=2,node=2", "Reason": "None"}
    return "|".join(values[f] for f in SACCT_FIELDS)


def _job_log(restart_at: str, lines: list[str]) -> list[str]:
    return [f"[pretrain-pipeline] job 1 restart 0 on vm1 at {restart_at}Z", *lines]


def _train(iteration: int, when: str, ms: float = 1000.0) -> str:
    # Bridge's line carries the wall clock at its start; patch it to the scenario's time.
    line = ml.iteration_line(iteration, 10, iteration * 8, ms, 1e-3, 8, 5.0, 0.5, 0, 0)
    return f" [{when}]" + line[line.index("]") + 1:]


def test_iterations_trained_twice_are_lost_work() -> None:
    """Job 10 saves at 5, trains 6 and 7, then fails; job 11 resumes from 5: 6 and 7 twice."""
    sacct = "\n".join([
        _sacct_row(10, "FAILED", "2026-12-01T10:00:00", "2026-12-01T10:00:10",
                   "2026-12-01T10:01:00"),
        _sacct_row(11, "COMPLETED", "2026-12-01T10:01:20", "2026-12-01T10:01:30",
                   "2026-12-01T10:02:30"),
    ])
    rows = read_sacct(sacct).records
    first = _job_log("2026-12-01T10:00:10", [
        *[_train(i, f"2026-12-01 10:00:{30 + i:02d}") for i in range(1, 6)],
        ml.saved_line(5, "/ck"), ml.timer_lines("save-checkpoint", 2000.0),
        _train(6, "2026-12-01 10:00:38"), _train(7, "2026-12-01 10:00:39"),
        ml.failed_line(7, "RuntimeError: NCCL timeout"),
    ])
    second = _job_log("2026-12-01T10:01:30", [
        ml.loaded_line("/ck", 5), ml.timer_lines("load-checkpoint", 3000.0),
        *[_train(i, f"2026-12-01 10:01:{50 + i - 5:02d}") for i in range(6, 11)],
        ml.saved_line(10, "/ck"), ml.timer_lines("save-checkpoint", 2000.0),
    ])
    jobs = [goodput.segment_job(rows["10"], first, nodes=2),
            goodput.segment_job(rows["11"], second, nodes=2)]
    figures = goodput.compute(jobs)
    assert figures.iterations_trained == 10 and figures.iterations_redone == 2
    assert figures.redone_s == 2 * 1.0 * 2  # two 1 s steps on two nodes
    assert figures.train_s == 10 * 1.0 * 2
    assert figures.allocated_node_s == (50 + 60) * 2
    assert figures.goodput_in_jobs == pytest.approx(20 / 220)
    # 10:00:10 to 10:02:30 on two nodes: the 30 s between the jobs count against it
    assert figures.span_node_s == 140 * 2
    assert figures.goodput == pytest.approx(20 / 280)
    assert figures.save_s == 2 * 2.0 * 2 and figures.load_s == 3.0 * 2
    assert figures.queue_s == 10 + 10 and figures.gap_s == 30
    # first step of job 10: its line at 10:00:31 minus its 1 s: 20 s after the 10:00:10 start
    assert jobs[0].runs[0].first_step_at == datetime(2026, 12, 1, 10, 0, 30)
    assert figures.startup_s == (20 + 20) * 2
    kinds = [(s.segment, s.kind) for s in goodput.timeline(jobs)]
    # job 11 is job 10's retry: one segment, its failed run and its training
    assert (1, goodput.FAILED) in kinds and (1, goodput.TRAINING) in kinds
    assert {number for number, _ in kinds} == {1}


def test_no_jobs_no_goodput() -> None:
    figures = goodput.compute([])
    assert figures.goodput is None and figures.segments == 0
    assert "goodput" not in figures.components()


def test_a_job_without_steps_is_all_start_up() -> None:
    record = JobRecord("5", "x", "FAILED", start=datetime(2026, 1, 1, 0, 0, 0),
                       end=datetime(2026, 1, 1, 0, 1, 0), submit=datetime(2026, 1, 1))
    figures = goodput.compute([goodput.segment_job(record, ["Traceback: ImportError"], 1)])
    assert figures.startup_s == 60 and figures.train_s == 0 and figures.goodput == 0


def test_a_logging_interval_spreads_its_mean_step_time_over_its_iterations() -> None:
    """With log_interval 2 Megatron prints every other iteration, the mean over the two."""
    rows = read_sacct(_sacct_row(12, "COMPLETED", "2026-12-01T10:00:00", "2026-12-01T10:00:10",
                                 "2026-12-01T10:01:00")).records
    log = _job_log("2026-12-01T10:00:10", [
        ml.loaded_line("/ck", 4),
        _train(6, "2026-12-01 10:00:30", ms=500.0), _train(8, "2026-12-01 10:00:31", ms=500.0)])
    job = goodput.segment_job(rows["12"], log, nodes=1)
    assert [s.iteration for s in job.runs[0].steps] == [5, 6, 7, 8]
    assert goodput.compute([job]).train_s == 4 * 0.5
    # the first step began two 0.5 s steps before the first line
    assert job.runs[0].first_step_at == datetime(2026, 12, 1, 10, 0, 29)


def _chain(gap_s: int) -> list[goodput.SegmentJob]:
    """Three 60 s segment jobs, each training 10 1-s steps, ``gap_s`` apart."""
    jobs = []
    for n in range(3):
        start = datetime(2026, 12, 1, 10, 0, 0).timestamp() + n * (60 + gap_s)
        at = [datetime.fromtimestamp(start + k).isoformat(timespec="seconds")
              for k in (0, 60)]
        rows = read_sacct(_sacct_row(20 + n, "COMPLETED", at[0], at[0], at[1])).records
        steps = [_train(10 * n + i, at[0].replace("T", " ")) for i in range(1, 11)]
        jobs.append(goodput.segment_job(rows[str(20 + n)], _job_log(at[0], steps), nodes=1))
    return jobs


def test_the_gaps_between_segments_lower_goodput_and_nothing_else_does() -> None:
    """What pre-queueing removes (the gaps) shows in ``goodput``, not in ``goodput_in_jobs``."""
    serial, prequeued = goodput.compute(_chain(12)), goodput.compute(_chain(0))
    assert serial.goodput_in_jobs == prequeued.goodput_in_jobs == pytest.approx(30 / 180)
    assert prequeued.goodput == pytest.approx(30 / 180)
    assert serial.goodput == pytest.approx(30 / (180 + 2 * 12))
    assert serial.gap_median_s == 12 and prequeued.gap_median_s == 0


def test_a_job_the_watchdog_stopped_counts_from_its_last_step_as_hang() -> None:
    """Job 30 trains to 3 (last line 10:00:33), hangs, is stopped at 10:01:00: 27 s hung; its
    retry resumes. The hung job is its segment's failure in the timeline."""
    rows = read_sacct("\n".join([
        _sacct_row(30, "CANCELLED", "2026-12-01T10:00:00", "2026-12-01T10:00:10",
                   "2026-12-01T10:01:00"),
        _sacct_row(31, "COMPLETED", "2026-12-01T10:01:05", "2026-12-01T10:01:05",
                   "2026-12-01T10:01:40")])).records
    hung = goodput.segment_job(rows["30"], _job_log("2026-12-01T10:00:10", [
        _train(i, f"2026-12-01 10:00:{30 + i:02d}") for i in (1, 2, 3)]), nodes=2, hung=True)
    retry = goodput.segment_job(rows["31"], _job_log("2026-12-01T10:01:05", [
        _train(i, f"2026-12-01 10:01:{20 + i:02d}") for i in (1, 2, 3, 4)]), nodes=2)
    assert hung.runs[0].last_step_at == datetime(2026, 12, 1, 10, 0, 33)
    figures = goodput.compute([retry, hung])
    assert figures.hang_s == 27 * 2
    assert figures.iterations_redone == 3 and figures.segments == 2
    assert [n for n, _ in goodput.numbered([retry, hung])] == [1, 1]
    assert {(s.segment, s.kind) for s in goodput.timeline([hung, retry])} >= {
        (1, goodput.FAILED), (1, goodput.TRAINING)}
    # the same job not flagged: a slow job, no hang time
    assert goodput.compute([replace(hung, hung=False), retry]).hang_s == 0


def test_a_job_recorded_twice_counts_once_and_its_finished_record_wins() -> None:
    from operators.campaign.adapters.goodput_log import job_entries

    finished = [{"slurm": {"job_id": "7"}, "log_path": "/l/7", "end_iteration": 10}]
    failed = [{"slurm": {"job_id": "6"}, "log_path": "/l/6", "hung": True},
              {"slurm": {"job_id": "6"}, "log_path": "/l/6", "hung": True},  # re-attached
              {"slurm": {"job_id": "7"}, "log_path": "/l/7"},
              {"slurm": None, "log_path": "/l/8"}]  # never submitted: nothing to count
    entries = job_entries(finished, failed)
    assert sorted(e["slurm"]["job_id"] for e in entries) == ["6", "7"]
    assert [e for e in entries if e["slurm"]["job_id"] == "7"] == finished

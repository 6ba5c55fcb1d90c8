"""Pre-queued segments on the local cluster (issue 15 §1, docs/prequeue.md).

1. Without Airflow, through the hook: a pre-queued job behind a segment that exited 0 without
   advancing the checkpoint refuses at its start (exit code 3, segment.json stop_reason
   ``prequeue_refused``) and never runs its command; the job queued behind that one, and one
   queued behind a job its task cancelled (the trigger's ``on_kill`` path), are removed by
   Slurm itself (``afterok`` + ``--kill-on-invalid-dep``) without ever starting.
2. Under the session's real ``airflow standalone`` (tests/dags/prequeue_chains.py): marking
   the running segment's task failed, clearing it, or marking the DAG run failed cancels the
   job pre-queued behind it before it starts (three campaigns at once, one per action).

The Airflow-down story (every component stopped while segment 1 trains, segment 2 finishing
by itself, the DAG catching up) is tests/pipeline/test_prequeue_airflow_down.py: it stops
its Airflow, so it runs one of its own rather than the session's.
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import subprocess
import urllib.error
import uuid
from pathlib import Path

import pytest

from jobscripts.job_files import SEGMENT_RESULT
from jobscripts.segment_gate import EXIT_REFUSED
from jobscripts.vocabulary import PREQUEUE_REFUSED, TIME_LIMIT
from operators.campaign.dag import prequeue
from operators.slurm.jobkey import job_key
from operators.slurm.messages import JobRequest
from operators.slurm.operator import XCOM_JOB
from tests.dags import prequeue_chains as chains
from tests.support import cluster
from tests.support.reference_campaign import campaign_doc, prepare_data

pytestmark = [pytest.mark.cluster]

HANG_AT = 1  # the cancel story's segment 1 hangs after its first iteration


def _squeue_state(key: str) -> str:
    return subprocess.run(["squeue", "-h", f"--name={key}", "-o", "%T"], capture_output=True,
                          text=True, check=True).stdout.strip()


def _wait_ended(job_id: str, timeout: float = 180) -> dict:
    return cluster.wait_for(lambda: (row := cluster.sacct_job(job_id))["state"] not in (
        "", "PENDING", "RUNNING", "COMPLETING") and row, timeout, f"job {job_id} to end")


def test_a_prequeued_job_refuses_after_no_progress_and_slurm_drops_the_rest(hook) -> None:
    from operators.campaign.adapters.code_ship import ship, with_pythonpath
    from operators.campaign.adapters.remote import write_file
    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.load import campaign_from_dict
    from operators.slurm.operator import PYTHON_ENV, build_spec

    root = "/home/pretrain/pp-test-prequeue-gate"
    hook.check(f"rm -rf {shlex.quote(root)}")
    campaign = campaign_from_dict(campaign_doc("prequeue_gate", Path(root), "/x/tokenizer",
                                               "/x/data/prefix", segments=3, iters=4, depth=2))
    layout = Layout.for_campaign(campaign)
    environment = with_pythonpath({PYTHON_ENV: hook.settings.remote_python},
                                  ship(hook, layout))
    checkpoints = posixpath.dirname(layout.tracker)
    write_file(hook, layout.tracker, "4")  # where the campaign stands
    run = uuid.uuid4().hex

    def submit(segment: int, request: JobRequest) -> tuple[str, str]:
        key = job_key("prequeue_gate", run, f"segment_{segment}", -1, segment)
        run_dir = hook.run_dir(key)
        spec = build_spec(key, run_dir, request.command, request.job, environment)
        return hook.submit(spec, run_dir), run_dir

    job = {"partition": "debug", "time": "2", "cpus_per_task": 1, "mem": "200M"}
    # Segment 1 exits 0 after a planned stop, without advancing the tracker (still at 4).
    record = {"start_iteration": 4, "end_iteration": 4, "stop_reason": TIME_LIMIT}
    one, one_dir = submit(1, JobRequest(
        f"sleep 3; printf '%s' {shlex.quote(json.dumps(record))} > {SEGMENT_RESULT}", job))
    two, two_dir = submit(2, prequeue.gated(JobRequest("echo TRAINED-AGAIN", job), one,
                                            one_dir, checkpoints, 12))
    three, three_dir = submit(3, prequeue.gated(JobRequest("echo THREE-RAN", job), two,
                                                two_dir, checkpoints, 12))
    # A segment whose task is killed while its successor waits: the trigger's on_kill path.
    four, four_dir = submit(4, JobRequest("sleep 120", job))
    five, five_dir = submit(5, prequeue.gated(JobRequest("echo FIVE-RAN", job), four,
                                              four_dir, checkpoints, 12))
    cluster.wait_for(lambda: cluster.sacct_job(four)["state"] == "RUNNING", 120, "job 4 runs")
    hook.cancel(four, killed_in=four_dir)

    assert _wait_ended(one)["state"] == "COMPLETED"
    refused = _wait_ended(two)
    assert (refused["state"], refused["exit"]) == ("FAILED", f"{EXIT_REFUSED}:0")
    result = hook.read_json(posixpath.join(two_dir, SEGMENT_RESULT))
    assert result["stop_reason"] == PREQUEUE_REFUSED
    assert "made no progress: the checkpoint tracker is at 4, it started at 4" in \
        result["stop_detail"]
    log_two = hook.read_bytes(posixpath.join(two_dir, f"slurm-{two}.out")).decode()
    assert "[segment_gate] refused (prequeue_refused, exit 3)" in log_two
    assert "TRAINED-AGAIN" not in log_two
    for job_id, run_dir in ((three, three_dir), (five, five_dir)):
        ended = _wait_ended(job_id)
        assert ended["state"].startswith("CANCELLED"), ended  # by Slurm: never satisfiable
        # Never ran: no node was allocated. (Start says nothing: sacct showed "None" for one
        # such job and the cancel time, Start == End, for the other, 2026-12-03.)
        assert cluster.sacct_field(job_id, "NodeList") == "None assigned", ended
        assert hook.read_bytes(posixpath.join(run_dir, f"slurm-{job_id}.out")) == b""
    hook.check(f"rm -rf {shlex.quote(root)}")


# -- under the session's airflow standalone (tests/dags/prequeue_chains.py) ------------------

def _doc(name: str) -> dict:
    doc = campaign_doc(name, chains.ROOT, str(chains.TOKENIZER), str(chains.PREFIX),
                       segments=chains.SEGMENTS, iters=chains.ITERS, depth=1, retries=1,
                       hang_timeout_min=60)
    # Start-up took over 2 min at load ~20 here: a start-up estimate and a time limit that
    # leave each segment its 4 iterations (a hung segment 1 outlasts the test's actions).
    doc["cluster"]["time_limit"] = "15"
    doc["segments"]["startup_estimate_min"] = 4
    return doc


def _hang(name: str) -> None:
    """Segment 1 of ``name`` hangs after HANG_AT (the fault fires once per writing),
    deaf to SIGTERM like a rank stuck in a collective: a cancelled job then saves nothing,
    and the cleared task's next try starts from 0 and hangs again."""
    from jobscripts.job_files import REFERENCE_FAULTS
    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.load import campaign_from_dict

    checkpoints = Path(Layout.for_campaign(campaign_from_dict(_doc(name))).checkpoints)
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / REFERENCE_FAULTS).write_text(json.dumps(
        {"hang": {"at_iteration": HANG_AT, "signals": False}}))
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(chains.ROOT)], check=True)


@pytest.fixture(scope="module")
def chain_data():
    """The chains' tokenizer and dataset (prepare_data), fresh campaign directories, and
    the campaign files their DAGs are made of (removed after: no DAG outlives the test)."""
    import shutil

    import yaml

    shutil.rmtree(chains.ROOT, ignore_errors=True)
    chains.ROOT.mkdir(parents=True)
    tokenizer, prefix = prepare_data(chains.ROOT)
    assert (tokenizer, prefix) == (str(chains.TOKENIZER), str(chains.PREFIX))
    chains.CAMPAIGNS_DIR.mkdir()
    for name in chains.CANCEL.values():
        (chains.CAMPAIGNS_DIR / f"{name}.yaml").write_text(yaml.safe_dump(_doc(name)))
    _reparse()
    yield
    shutil.rmtree(chains.CAMPAIGNS_DIR, ignore_errors=True)
    _reparse()


def _reparse() -> None:
    """Have the DAG processor parse the chains' DAG file again now: it re-parses a file
    modified since its last parse at once, and others only every min_file_process_interval."""
    os.utime(chains.__file__)


def _keys(name: str, run_id: str) -> dict[int, str]:
    return {i: job_key(chains.dag_id(name), run_id, f"segment_{i}", -1, i)
            for i in range(1, chains.SEGMENTS + 1)}


def _xcom(af, name: str, run_id: str, key: str):
    """Segment 1's XCom ``key``, None while the task has not pushed it."""
    try:
        return af.xcom(chains.dag_id(name), run_id, "segment_1", key=key)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _hung_with_successor_queued(af, name: str, run_id: str,
                                not_before: tuple[str, str] | None = None):
    """(segment 1's job, segment 2's) once segment 1 hangs in a deferred task and segment
    2's job, the one segment 1's task says it queued, waits behind it in Slurm's queue; else
    None. ``not_before``: the jobs of an earlier try, which do not count.

    The jobs are found by id (the task's XComs), not by name: ``sacct --starttime`` leaves
    out a job that pends on a dependency (no eligible time yet; seen on this cluster's
    slurmdbd), so a by-name look-up never sees the pre-queued job pending."""
    if af.task_instance(chains.dag_id(name), run_id, "segment_1")["state"] != "deferred":
        return None
    where = _xcom(af, name, run_id, XCOM_JOB)
    queued = _xcom(af, name, run_id, prequeue.XCOM_PREQUEUED)
    if not (where and queued):
        return None
    first, second = where["job_id"], queued[0]["job_id"]
    second_key = queued[0]["key"]
    if not_before is not None and (first in not_before or second in not_before):
        return None  # the earlier try's, still in XCom
    if cluster.sacct_job(first)["state"] != "RUNNING" or _squeue_state(second_key) != "PENDING":
        return None
    log = cluster.read_local_bytes(where["log_path"]).decode(errors="replace")
    if f"TEST FAULT: hanging after iteration {HANG_AT}" not in log:
        return None
    assert [(p["segment"], p["key"], p["after_job"]) for p in queued] == [
        (2, _keys(name, run_id)[2], first)], queued
    return first, second


def _never_started(job_id: str) -> dict:
    ended = _wait_ended(job_id)
    assert ended["state"].startswith("CANCELLED"), ended  # by Slurm: never satisfiable
    assert cluster.sacct_field(job_id, "Start") in ("None", "Unknown"), ended
    return ended


@pytest.mark.airflow
@pytest.mark.timeout(1800)  # with the session Airflow's start, on a loaded machine
def test_cancelling_the_running_segment_cancels_its_prequeued_successor(standalone,
                                                                         chain_data) -> None:
    """Marking the running segment's task failed, clearing it, and marking the DAG run
    failed each end its job (the trigger's on_kill) and with it the job pre-queued behind
    it, which never starts (afterok + --kill-on-invalid-dep): nothing trains that no task
    watches. Three campaigns at once, one per action."""
    af = standalone
    for name in chains.CANCEL.values():
        _hang(name)
        # The DAGs appear on the DAG processor's next pass after chain_data wrote their
        # files (a pass took 30-40 s here at load 14; trigger's own wait is 120 s).
        af.wait_dag(chains.dag_id(name), timeout=600)
    runs = {how: af.trigger(chains.dag_id(name)) for how, name in chains.CANCEL.items()}
    jobs = {how: cluster.wait_for(
        lambda h=how: _hung_with_successor_queued(af, chains.CANCEL[h], runs[h]), 900,
        f"{how}: segment 1 hung with segment 2 pre-queued", interval=3) for how in runs}
    _hang(chains.CANCEL["clear"])  # the cleared task's next try hangs too

    def dag_run(how: str) -> str:
        return f"/api/v2/dags/{chains.dag_id(chains.CANCEL[how])}/dagRuns/{runs[how]}"

    af.set_task_state(chains.dag_id(chains.CANCEL["failed"]), runs["failed"], "segment_1",
                      "failed")
    af.request("POST", f"/api/v2/dags/{chains.dag_id(chains.CANCEL['clear'])}/"
               "clearTaskInstances",
               {"dry_run": False, "dag_run_id": runs["clear"], "task_ids": ["segment_1"],
                "only_failed": False, "reset_dag_runs": True})
    af.request("PATCH", dag_run("runfail"), {"state": "failed"})
    for how, (first, second) in jobs.items():
        assert _wait_ended(first, 300)["state"].startswith("CANCELLED"), how
        _never_started(second)
        name = chains.CANCEL[how]
        cluster.wait_for(lambda n=name, h=how, f=first: (
            f"task killed while deferred: cancelling Slurm job {f}" in af.task_log(
                chains.dag_id(n), runs[h], "segment_1", try_number=1)), 300,
            f"{how}: the trigger's on_kill in segment 1's log", interval=5)

    # Cleared means run again: the next try submits its own job and queues segment 2 anew
    # (a second job under segment 2's key, the old one removed); failing the run ends both.
    name = chains.CANCEL["clear"]
    again = cluster.wait_for(
        lambda: _hung_with_successor_queued(af, name, runs["clear"], jobs["clear"]), 900,
        "the cleared segment 1 hung again, segment 2 queued again", interval=3)
    # One retry: a cleared try can meet Airflow's stale executor event (apache/airflow#72716,
    # seen here: "finished with state success, but the task instance's state attribute is
    # running"); a user's mark-failed or run-failed is not retried.
    assert af.task_instance(chains.dag_id(name), runs["clear"], "segment_1")["try_number"] >= 2
    af.request("PATCH", dag_run("clear"), {"state": "failed"})
    assert _wait_ended(again[0], 300)["state"].startswith("CANCELLED")
    _never_started(again[1])
    for how in runs:
        name = chains.CANCEL[how]
        # Each segment 1 ends failed, as the user asked. The run itself ends failed, or, when
        # the scheduler was evaluating it as the PATCH landed, success: seen here (its leaf
        # segment_3 had just been SKIPPED by Airflow's mark-run-failed, and the scheduler's
        # "Marking run ... successful" overwrote "failed"): Airflow's race, not the chain's.
        assert af.task_instance(chains.dag_id(name), runs[how], "segment_1")["state"] \
            == "failed", how
        assert af.run_state(chains.dag_id(name), runs[how]) in ("failed", "success"), how
        keys = _keys(name, runs[how])
        # depth 1: segment 3 was never queued, and nothing of segments 2-3 ran
        assert _squeue_state(keys[3]) == "" and cluster.sacct_by_name(keys[3]) == [], how
        assert _squeue_state(keys[2]) == "", how
        assert all(cluster.sacct_field(r["id"], "Start") in ("None", "Unknown")
                   for r in cluster.sacct_by_name(keys[2])), how

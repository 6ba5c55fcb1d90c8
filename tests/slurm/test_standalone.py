"""The Slurm layer under a real ``airflow standalone``: scheduler, triggerer, REST API.

Runs are triggered through the REST API as the UI does. Slow jobs are started
together up front so that their waits overlap.
"""

from __future__ import annotations

import subprocess
import time
from datetime import datetime

import pytest

from tests.support import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.airflow]


def job_of(af, dag_id: str, run_id: str, task_id: str) -> dict:
    return af.xcom(dag_id, run_id, task_id, key="slurm_job")


def test_success_chain_array_timeout_and_failure(standalone) -> None:
    af = standalone
    runs = {dag: af.trigger(dag) for dag in
            ("slurm_timeout", "slurm_success", "slurm_chain", "slurm_array", "slurm_fail")}

    assert af.wait_run("slurm_success", runs["slurm_success"]) == "success"
    result = af.xcom("slurm_success", runs["slurm_success"], "hello")
    assert result["result"] == {"answer": 42}
    assert result["record"]["state"] == "COMPLETED" and result["record"]["exit_code"] == 0
    log = af.task_log("slurm_success", runs["slurm_success"], "hello")
    assert "hello from" in log and "line two" in log  # streamed by the real triggerer

    assert af.wait_run("slurm_chain", runs["slurm_chain"]) == "success"
    first = af.xcom("slurm_chain", runs["slurm_chain"], "first")
    second = af.xcom("slurm_chain", runs["slurm_chain"], "second")["record"]
    assert first["state"] in ("PENDING", "RUNNING")  # returned at submission
    first_end = cluster.sacct_field(first["job_id"], "End")
    # Slurm held the second job until the first completed (afterok).
    assert datetime.fromisoformat(second["start"]) >= datetime.fromisoformat(first_end)
    assert af.task_instance("slurm_chain", runs["slurm_chain"], "wait_first")["state"] == "success"

    assert af.wait_run("slurm_array", runs["slurm_array"]) == "success"
    array = af.xcom("slurm_array", runs["slurm_array"], "fanout")
    files = cluster.remote(f"cat {array['run_dir']}/task-*.txt").split("\n")
    assert [f for f in files if f] == ["task 0", "task 1", "task 2"]

    assert af.wait_run("slurm_fail", runs["slurm_fail"]) == "failed"
    log = af.last_log("slurm_fail", runs["slurm_fail"], "boom")
    assert "exit code 3" in log and "the reason: disk on fire" in log

    assert af.wait_run("slurm_timeout", runs["slurm_timeout"], timeout=240) == "failed"
    job = job_of(af, "slurm_timeout", runs["slurm_timeout"], "overrun")
    assert cluster.sacct_job(job["job_id"])["state"] == "TIMEOUT"
    log = af.task_log("slurm_timeout", runs["slurm_timeout"], "overrun")
    assert "ended TIMEOUT" in log and "classified time_limit" in log


def _running_jobs(af, run_id: str) -> dict[str, str]:
    """Wait until both slurm_long tasks hold a RUNNING job; task id -> job id."""
    def ready():
        jobs = {}
        for task in ("long_deferred", "long_in_worker"):
            try:
                jobs[task] = job_of(af, "slurm_long", run_id, task)["job_id"]
            except Exception:  # noqa: BLE001 - XCom not there yet
                return None
        if all(cluster.sacct_job(j)["state"] == "RUNNING" for j in jobs.values()):
            return jobs
        return None
    jobs = cluster.wait_for(ready, 120, "both slurm_long jobs to run")
    af.wait_task_state("slurm_long", run_id, "long_deferred", {"deferred"})
    af.wait_task_state("slurm_long", run_id, "long_in_worker", {"running"})
    return jobs


def test_marking_tasks_failed_cancels_their_jobs(standalone) -> None:
    af = standalone
    run_id = af.trigger("slurm_long", {"sleep": 600})
    jobs = _running_jobs(af, run_id)
    for task in jobs:
        af.set_task_state("slurm_long", run_id, task, "failed")
    for task, job_id in jobs.items():
        state = cluster.wait_for(
            lambda j=job_id: (s := cluster.sacct_job(j)["state"]).startswith("CANCELLED") and s,
            300, f"{task}'s job {job_id} to be cancelled")  # 90 s fell short at load ~12
        assert state.startswith("CANCELLED"), task


@pytest.mark.disruptive
def test_sshd_restart_during_polling_loses_nothing_and_duplicates_nothing(standalone) -> None:
    af = standalone
    run_id = af.trigger("slurm_long", {"sleep": 45})
    jobs = _running_jobs(af, run_id)
    cluster.drop_sshd()
    time.sleep(12)  # both the trigger and the worker poll into a dead sshd meanwhile
    cluster.restart_cluster_services()
    assert af.wait_run("slurm_long", run_id, timeout=240) == "success"
    for job_id in jobs.values():
        name = cluster.sacct_job(job_id)["name"]
        assert [r["id"] for r in cluster.sacct_by_name(name)] == [job_id]


def test_retry_of_a_task_whose_job_still_runs_reattaches(standalone) -> None:
    af = standalone
    run_id = af.trigger("slurm_retry_reattach")
    assert af.wait_run("slurm_retry_reattach", run_id, timeout=240) == "success"
    ti = af.task_instance("slurm_retry_reattach", run_id, "crashy")
    assert ti["try_number"] == 2
    out = af.xcom("slurm_retry_reattach", run_id, "crashy")
    assert out["result"] == {"answer": 42}
    rows = cluster.sacct_by_name(cluster.sacct_job(out["job_id"])["name"])
    assert [r["id"] for r in rows] == [out["job_id"]]  # one job for the key, not two
    log = af.task_log("slurm_retry_reattach", run_id, "crashy", try_number=2)
    assert f"re-attaching to Slurm job {out['job_id']}" in log


def _node_of(job_id: str) -> str:
    return cluster.sacct_field(job_id, "NodeList")


@pytest.mark.disruptive
def test_node_down_requeues_or_retries_and_loses_nothing(standalone) -> None:
    af = standalone
    run_id = af.trigger("slurm_node_down")
    tasks = ("requeueable", "not_requeueable")

    def running():
        try:
            jobs = {t: job_of(af, "slurm_node_down", run_id, t)["job_id"] for t in tasks}
        except Exception:  # noqa: BLE001 - XCom not there yet
            return None
        states = {cluster.sacct_job(j)["state"] for j in jobs.values()}
        return jobs if states == {"RUNNING"} else None
    jobs = cluster.wait_for(running, 120, "both slurm_node_down jobs to run")
    # Each job's node goes DOWN (one node when Slurm packed both there): both jobs lose theirs,
    # and at least one of the cluster's nodes stays up for what runs next.
    failed = {t: _node_of(j) for t, j in jobs.items()}
    down = ",".join(sorted(set(failed.values())))
    assert len(cluster.node_names()) > len(set(failed.values())), (failed, cluster.node_names())
    try:
        subprocess.run(["scontrol", "update", f"nodename={down}", "state=down",
                        "reason=pp-fault-test"], check=True)
        assert af.wait_run("slurm_node_down", run_id, timeout=300) == "success"
    finally:  # the nodes must come back whatever happened
        subprocess.run(["scontrol", "update", f"nodename={down}", "state=resume"],
                       capture_output=True)

    # Requeued by Slurm: the same job ran again, the task never failed.
    first = jobs["requeueable"]
    rows = cluster.sacct_by_name(cluster.sacct_job(first)["name"])
    assert [(r["id"], r["state"]) for r in rows] == [(first, "NODE_FAIL"), (first, "COMPLETED")]
    assert _node_of(first) not in set(failed.values())  # it ran again on a healthy node
    assert af.task_instance("slurm_node_down", run_id, "requeueable")["try_number"] == 1
    log = af.task_log("slurm_node_down", run_id, "requeueable")
    assert "requeued after NODE_FAIL" in log

    # Not requeueable: NODE_FAIL is retryable, and the task's retry submitted a new job.
    second = jobs["not_requeueable"]
    rows = cluster.sacct_by_name(cluster.sacct_job(second)["name"])
    assert [r["state"] for r in rows] == ["NODE_FAIL", "COMPLETED"]
    assert rows[0]["id"] == second and rows[1]["id"] != second
    first_try = af.task_log("slurm_node_down", run_id, "not_requeueable", try_number=1)
    ti = af.task_instance("slurm_node_down", run_id, "not_requeueable")
    assert ti["try_number"] == 2, (ti, first_try[-3000:])
    assert "ended NODE_FAIL" in first_try and "classified retryable" in first_try
    retry = af.task_log("slurm_node_down", run_id, "not_requeueable", try_number=2)
    lost = failed["not_requeueable"]
    # The cluster can spare the failed node: the retry was submitted with --exclude=<it>
    # (its script says so) and sacct's NodeList shows it ran elsewhere.
    assert f"retry after NODE_FAIL on {lost}: excluding those nodes" in retry
    run_dir = job_of(af, "slurm_node_down", run_id, "not_requeueable")["run_dir"]
    assert f"#SBATCH --exclude={lost}\n" in cluster.remote(f"cat {run_dir}/job.sbatch")
    assert _node_of(rows[1]["id"]) not in ("", lost)
    assert af.xcom("slurm_node_down", run_id, "not_requeueable")["result"] == {"answer": 42}


def test_clearing_running_tasks_cancels_their_jobs(standalone) -> None:
    af = standalone
    run_id = af.trigger("slurm_long", {"sleep": 600})
    jobs = _running_jobs(af, run_id)
    af.request("POST", "/api/v2/dags/slurm_long/clearTaskInstances",
               {"dry_run": False, "dag_run_id": run_id, "task_ids": list(jobs),
                "only_failed": False, "reset_dag_runs": True})
    for task, job_id in jobs.items():
        state = cluster.wait_for(
            lambda j=job_id: (s := cluster.sacct_job(j)["state"]).startswith("CANCELLED") and s,
            300, f"{task}'s job {job_id} to be cancelled")  # 90 s fell short at load ~12
        assert state.startswith("CANCELLED"), task
    # Cleared means run again: each task's next try submits a fresh job. Stop those too.
    def new_jobs():
        try:
            now = {t: job_of(af, "slurm_long", run_id, t)["job_id"] for t in jobs}
        except Exception:  # noqa: BLE001 - not submitted yet
            return None
        return now if all(now[t] != jobs[t] for t in jobs) else None
    fresh = cluster.wait_for(new_jobs, 180, "the cleared tasks to submit again")

    def watched():  # a task marked failed before its trigger starts is not a kill
        log = af.task_log("slurm_long", run_id, "long_deferred", try_number=2)
        return f"Slurm job {fresh['long_deferred']} is" in log
    # A failure detector, sized for CI's load: there the triggerer took over 120 s to start
    # the new trigger (its other triggers and the lane's jobs share two cores).
    try:
        cluster.wait_for(watched, 360, "the new trigger to watch the fresh job", 2)
    except TimeoutError as exc:
        ti = af.task_instance("slurm_long", run_id, "long_deferred")
        raise TimeoutError(f"{exc}; task {ti['state']} try {ti['try_number']}; its log:\n"
                           + af.task_log("slurm_long", run_id, "long_deferred",
                                         try_number=ti["try_number"])[-3000:]) from exc
    for task in jobs:
        af.set_task_state("slurm_long", run_id, task, "failed")
    for job_id in fresh.values():
        cluster.wait_for(lambda j=job_id: cluster.sacct_job(j)["state"].startswith("CANCELLED"),
                         90, f"job {job_id} to be cancelled")

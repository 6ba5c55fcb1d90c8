"""Faults of 2-node jobs under a real ``airflow standalone`` (its triggerer follows the jobs),
on the cluster's ``faults`` partition (tests/support/fault_nodes.py). DAGs:
tests/dags/multinode_faults.py.

- A node set DOWN under a running 2-node segment (``--requeue``): Slurm requeues the job on the
  healthy pair; the task follows the same job id in the same try, the job resumes from the
  checkpoint it saved on Slurm's SIGTERM and trains nothing twice.
- The same under a ``--no-requeue`` job: NODE_FAIL fails the try; the retry keeps off the
  node that failed (``--exclude``) and runs on the other two.
- One rank SIGKILLed: the try fails at once (not at the time limit) and the retry resumes
  from the last checkpoint.

The node being cut off and a taken rendezvous port are the job's business, not the task's:
tests/trainer/test_multinode_faults.py (through the worker's SlurmHook). Times from each
fault to the task's end are printed, not asserted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from jobscripts.job_files import SEGMENT_RESULT
from operators.slurm.messages import JobLocation
from operators.slurm.operator import XCOM_JOB
from tests.dags.multinode_faults import (
    CAMPAIGNS,
    KILLED_RANK,
    NO_REQUEUE,
    PREFIX,
    REQUEUE,
    SAVE_INTERVAL,
    TRAIN_ITERS,
)
from tests.support import cluster
from tests.support.fault_nodes import (
    HANG,
    HANG_AT,
    HANG_LINE,
    held,
    job_field,
    set_node_down,
    trainer_pid,
)
from tests.support.trainer import lay_out_segment_campaigns, losses

pytestmark = [pytest.mark.cluster, pytest.mark.airflow, pytest.mark.fault_nodes]

SEGMENT = "segment_1"
RUN_TIMEOUT_S = 900  # a 2-node segment on the loaded 2-core machine, its retry included


@pytest.fixture(scope="module")
def laid_out(local_cluster) -> None:
    lay_out_segment_campaigns(Path(PREFIX), [(c, HANG) for c in CAMPAIGNS.values()])


def submitted(af, dag_id: str, run_id: str, task_id: str, timeout: float = 300,
              other_than: str | None = None) -> JobLocation:
    """Where the task's current try put its job (XCom, pushed before the task defers)."""
    def found():
        try:
            where = JobLocation.from_json(af.xcom(dag_id, run_id, task_id, key=XCOM_JOB))
        except OSError:  # urllib's HTTPError: no XCom yet
            return None
        return where if where.job_id != other_than else None
    try:
        return cluster.wait_for(found, timeout, f"{task_id}'s job in {dag_id}")
    except TimeoutError as timed_out:
        raise TimeoutError(f"{timed_out}\n{af.run_report(dag_id, run_id)}") from None


def job_log(where: JobLocation) -> str:
    return Path(where.log_path).read_text(errors="replace")


def wait_hanging(af, dag_id: str, run_id: str, where: JobLocation) -> None:
    try:
        cluster.wait_for(lambda: Path(where.log_path).exists() and HANG_LINE in job_log(where),
                         420, f"job {where.job_id} to reach its hang")
    except TimeoutError as timed_out:
        raise TimeoutError(f"{timed_out}\n{af.run_report(dag_id, run_id)}") from None


def segment_result(where: JobLocation) -> dict:
    return json.loads(Path(where.run_dir, SEGMENT_RESULT).read_text())


def finished(af, dag_id: str, run_id: str, task_id: str) -> tuple[str, int]:
    state = af.wait_run(dag_id, run_id, timeout=RUN_TIMEOUT_S)
    assert state == "success", af.run_report(dag_id, run_id)
    return state, af.task_instance(dag_id, run_id, task_id)["try_number"]


def test_a_node_set_down_under_a_segment_is_followed_through_slurms_requeue(
        standalone, laid_out, fault_nodes) -> None:
    af, nodes = standalone, fault_nodes
    with held(nodes.c):
        run_id = af.trigger(REQUEUE)
        where = submitted(af, REQUEUE, run_id, SEGMENT)
        wait_hanging(af, REQUEUE, run_id, where)
    assert job_field(where.job_id, "NodeList") == cluster.hostlist(nodes.a, nodes.b)
    try:
        set_node_down(nodes.b)
        down_at = time.monotonic()
        _, tries = finished(af, REQUEUE, run_id, SEGMENT)
        took = time.monotonic() - down_at
    finally:
        nodes.resume_all()
    log = af.task_log(REQUEUE, run_id, SEGMENT, try_number=1)
    # One try, one job: the trigger followed the job id through NODE_FAIL and the requeue.
    assert tries == 1, log[-3000:]
    assert af.xcom(REQUEUE, run_id, SEGMENT, key=XCOM_JOB)["job_id"] == where.job_id
    assert re.search(rf"Slurm job {where.job_id} is \w+ requeued after NODE_FAIL", log), \
        log[-3000:]
    rows = cluster.sacct_by_name(cluster.sacct_field(where.job_id, "JobName"))
    assert {r["id"] for r in rows} == {where.job_id}, rows  # one job for the key
    assert [r["state"] for r in rows] == ["NODE_FAIL", "COMPLETED"], rows  # its two runs
    assert cluster.sacct_field(where.job_id, "NodeList") == cluster.hostlist(nodes.a, nodes.c)
    # An admin's DOWN leaves the node's slurmd alive: Slurm signals the steps on both nodes,
    # the trainer saves iteration 3 on SIGTERM, and the requeued run resumes there.
    segment = segment_result(where)
    assert segment["resumed_from"]["iteration"] == HANG_AT
    assert segment["iterations_redone"] == 0
    assert segment["lease"] == {"job_id": where.job_id, "restart_count": 1}
    assert (segment["end_iteration"], segment["stop_reason"]) == (TRAIN_ITERS, "completed")
    # Both runs' lines are in the one log (appended): each iteration trained once.
    assert sorted(losses(job_log(where))) == list(range(1, TRAIN_ITERS + 1))
    print(f"node down -> task success: {took:.0f} s")


def test_a_node_set_down_under_a_no_requeue_job_is_excluded_by_the_retry(
        standalone, fault_nodes) -> None:
    af, nodes = standalone, fault_nodes
    task = "hold_two_nodes"
    with held(nodes.c):
        run_id = af.trigger(NO_REQUEUE)
        first = submitted(af, NO_REQUEUE, run_id, task)
        cluster.wait_for(lambda: job_field(first.job_id, "JobState") == "RUNNING", 300,
                         f"job {first.job_id} to run")
    assert job_field(first.job_id, "NodeList") == cluster.hostlist(nodes.a, nodes.b)
    try:
        set_node_down(nodes.b)
        _, tries = finished(af, NO_REQUEUE, run_id, task)
        retry_log = af.task_log(NO_REQUEUE, run_id, task, try_number=2)
        second = submitted(af, NO_REQUEUE, run_id, task, other_than=first.job_id)
    finally:
        nodes.resume_all()
    assert tries == 2
    assert cluster.sacct_field(first.job_id, "State") == "NODE_FAIL"
    assert f"Slurm job {first.job_id} ended NODE_FAIL" in af.task_log(
        NO_REQUEUE, run_id, task, try_number=1)
    assert (f"retry after NODE_FAIL on {nodes.b}: excluding those nodes" in retry_log), \
        retry_log[-3000:]
    assert cluster.sacct_field(second.job_id, "NodeList") == cluster.hostlist(nodes.a, nodes.c)
    assert sorted(job_log(second).split()[-2:]) == [nodes.a, nodes.c]  # srun hostname


def test_a_killed_rank_fails_the_try_at_once_and_the_retry_resumes(
        standalone, laid_out, fault_nodes) -> None:
    af = standalone
    run_id = af.trigger(KILLED_RANK)
    where = submitted(af, KILLED_RANK, run_id, SEGMENT)
    wait_hanging(af, KILLED_RANK, run_id, where)
    os.kill(trainer_pid(where.job_id, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    # --kill-on-bad-exit ends the job at once, not at its 10-minute limit.
    cluster.wait_for(lambda: cluster.sacct_field(where.job_id, "State") == "FAILED", 300,
                     f"job {where.job_id} to fail")
    failed_after = time.monotonic() - killed_at
    _, tries = finished(af, KILLED_RANK, run_id, SEGMENT)
    assert tries == 2
    first = af.task_log(KILLED_RANK, run_id, SEGMENT, try_number=1)
    assert f"Slurm job {where.job_id} ended FAILED" in first, first[-3000:]
    second = af.task_log(KILLED_RANK, run_id, SEGMENT, try_number=2)
    assert f"earlier job {where.job_id} for key" in second, second[-3000:]
    retry = submitted(af, KILLED_RANK, run_id, SEGMENT, other_than=where.job_id)
    segment = segment_result(retry)
    last_save = HANG_AT - HANG_AT % SAVE_INTERVAL
    assert segment["resumed_from"]["iteration"] == last_save
    assert segment["iterations_redone"] == HANG_AT - last_save
    assert (segment["end_iteration"], segment["stop_reason"]) == (TRAIN_ITERS, "completed")
    print(f"rank killed -> job FAILED: {failed_after:.0f} s; "
          f"-> retry succeeded: {time.monotonic() - killed_at:.0f} s")

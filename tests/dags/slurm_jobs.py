"""DAGs that exercise the Slurm layer against the local cluster (tests only)."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from operators.slurm.operator import SlurmJobOperator
from operators.slurm.sensor import SlurmJobSensor

CONN = "slurm_local"
COMMON = {"schedule": None, "start_date": datetime(2026, 1, 1), "catchup": False,
          "tags": ["test"]}
# Airflow 3.3's scheduler can fail a resumed deferral: a job that ends at once fires its trigger
# before the scheduler has drained the worker's "success" event for the deferring try, and that
# stale event then fails the running resumed try ("state mismatch"; apache/airflow#72716, open).
# Seen at CI's load on these short jobs; a retry re-attaches to the same job by key.
STALE_EVENT_RETRY = {"retries": 1, "retry_delay": timedelta(seconds=2)}
RESULT = "printf '{\"answer\": %s}' 42 > result.json"


class CrashAfterSubmit(SlurmJobOperator):
    """Dies on its first try right after submitting, as a worker lost mid-task would."""

    def on_job_found(self, context, record):
        # The job is submitted and its location pushed: what a retry re-attaches by.
        if context["ti"].try_number == 1:
            raise RuntimeError(f"simulated worker crash after submitting job {record.job_id}")


with DAG("slurm_success", **COMMON):
    SlurmJobOperator(task_id="hello", ssh_conn_id=CONN, result_file="result.json",
                     job={"time": "5", "cpus_per_task": 1}, **STALE_EVENT_RETRY,
                     command=f"echo hello from $(hostname); echo line two; {RESULT}")

with DAG("slurm_success_in_worker", **COMMON):
    SlurmJobOperator(task_id="hello", ssh_conn_id=CONN, result_file="result.json",
                     deferrable=False, poll_interval=1,
                     command=f"echo hello from the worker; {RESULT}")

with DAG("slurm_fail", **COMMON):
    SlurmJobOperator(task_id="boom", ssh_conn_id=CONN, **STALE_EVENT_RETRY,
                     command="echo about to fail; echo 'the reason: disk on fire' >&2; exit 3")

with DAG("slurm_timeout", **COMMON):
    SlurmJobOperator(task_id="overrun", ssh_conn_id=CONN, job={"time": "1"},
                     command="echo starting; sleep 400")

with DAG("slurm_chain", **COMMON):
    # Submitted without waiting: Slurm itself must hold `second` until `first` is done.
    first = SlurmJobOperator(task_id="first", ssh_conn_id=CONN, wait_for_completion=False,
                             command="sleep 15; echo first > first.txt")
    second = SlurmJobOperator(
        task_id="second", ssh_conn_id=CONN, **STALE_EVENT_RETRY,
        job={"dependency": "afterok:{{ ti.xcom_pull(task_ids='first')['job_id'] }}"},
        command="echo second ran after {{ ti.xcom_pull(task_ids='first')['job_id'] }}")
    wait_first = SlurmJobSensor(task_id="wait_first", ssh_conn_id=CONN,
                                job_id="{{ ti.xcom_pull(task_ids='first')['job_id'] }}")
    first >> [second, wait_first]

with DAG("slurm_array", **COMMON):
    SlurmJobOperator(task_id="fanout", ssh_conn_id=CONN, job={"array": "0-2"},
                     **STALE_EVENT_RETRY,  # CI met the race here (session 9)
                     command='echo "task $SLURM_ARRAY_TASK_ID" > "task-$SLURM_ARRAY_TASK_ID.txt"')

with DAG("slurm_long", params={"sleep": Param(120, type="integer", minimum=1),
                               "deferrable": Param(True, type="boolean")}, **COMMON):
    SlurmJobOperator(task_id="long_deferred", ssh_conn_id=CONN,
                     command="echo sleeping; sleep {{ params.sleep | int }}; echo woke")
    SlurmJobOperator(task_id="long_in_worker", ssh_conn_id=CONN, deferrable=False,
                     poll_interval=1,
                     command="echo sleeping; sleep {{ params.sleep | int }}; echo woke")

with DAG("slurm_retry_reattach", **COMMON):
    CrashAfterSubmit(task_id="crashy", ssh_conn_id=CONN, retries=1,
                     retry_delay=timedelta(seconds=1), result_file="result.json",
                     command=f"sleep 20; {RESULT}")

with DAG("slurm_hostile", params={"msg": "$(touch /tmp/pp-pwned-param)"}, **COMMON):
    SlurmJobOperator(
        task_id="quoted", ssh_conn_id=CONN, result_file="result.json",
        environment={"EVIL": "$(touch /tmp/pp-pwned-env); `touch /tmp/pp-pwned-env`\n;x",
                     "FROM_PARAM": "{{ params.msg }}"},
        files={"input.txt": "$(touch /tmp/pp-pwned-file)\n"},
        command='printf "%s|%s|%s" "$EVIL" "$FROM_PARAM" "$(cat input.txt)" > out.txt; '
                + RESULT)

with DAG("slurm_node_down", **COMMON):
    # The test sets the node DOWN while both run. Slurm requeues the first under the same job
    # id; the second (--no-requeue) ends NODE_FAIL, and its task's retry submits again.
    SlurmJobOperator(task_id="requeueable", ssh_conn_id=CONN, result_file="result.json",
                     job={"requeue": True}, command=f"sleep 40; {RESULT}")
    SlurmJobOperator(task_id="not_requeueable", ssh_conn_id=CONN, result_file="result.json",
                     retries=1, retry_delay=timedelta(seconds=2),
                     command=f"sleep 40; {RESULT}")

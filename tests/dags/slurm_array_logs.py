"""DAG for the array log streaming test (tests/slurm/test_standalone_array_logs.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG

from operators.slurm.operator import SlurmJobOperator

with DAG("slurm_array_logs", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         tags=["test"]):
    # Three tasks, each printing lines of its own over a few seconds: the task log must get
    # every task's lines while they run (the trigger once followed task 0 only). The retry is
    # for Airflow's stale-event race (see STALE_EVENT_RETRY in slurm_jobs.py).
    SlurmJobOperator(task_id="fanout", ssh_conn_id="slurm_local", job={"array": "0-2"},
                     poll_interval=2, retries=1, retry_delay=timedelta(seconds=2),
                     command='for i in 1 2 3 4; do echo "task $SLURM_ARRAY_TASK_ID line $i"; '
                             "sleep 1; done")

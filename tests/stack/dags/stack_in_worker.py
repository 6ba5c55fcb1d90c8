"""A task that waits on its Slurm job in the Celery worker (deferrable=False), for the stack
story's worker SIGKILL: its retry must run on the other worker and re-attach to the same job."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG

from operators.slurm.operator import SlurmJobOperator

with DAG("stack_in_worker", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         tags=["test"]):
    # Long enough to outlive the killed worker's heartbeat timeout (stack.env: 60 s) and the
    # retry's start on the other worker, on a loaded machine.
    SlurmJobOperator(task_id="wait_in_worker", ssh_conn_id="slurm_local", deferrable=False,
                     poll_interval=1, retries=1, retry_delay=timedelta(seconds=1),
                     job={"time": "10", "cpus_per_task": 1}, result_file="result.json",
                     command="echo waiting; sleep 300; printf '{\"waited\": 300}' > result.json")

"""DAGs for the Slurm output shapes of issue 13 (tests/slurm/test_standalone_shapes.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG

from operators.slurm.operator import SlurmJobOperator

CONN = "slurm_local"
COMMON = {"schedule": None, "start_date": datetime(2026, 1, 1), "catchup": False,
          "tags": ["test"]}

with DAG("slurm_array_task_fails", **COMMON):
    # Task 1 of 3 fails: the task must fail naming it, and its retry must submit again.
    SlurmJobOperator(task_id="fanout", ssh_conn_id=CONN, job={"array": "0-2"}, retries=1,
                     retry_delay=timedelta(seconds=1),
                     command='sleep 3; [ "$SLURM_ARRAY_TASK_ID" != 1 ] || exit 7')

# The ticker's lines: one a second, so that it outlasts the test's 2-minute slurmdbd outage.
TICKS = 170

with DAG("slurm_through_outage", **COMMON):
    # One line a second with its epoch time; the test stops slurmdbd meanwhile.
    SlurmJobOperator(task_id="ticker", ssh_conn_id=CONN, poll_interval=2,
                     result_file="result.json",
                     command=f'for i in $(seq {TICKS}); do echo "tick $i $(date +%s)"; sleep 1; '
                             f"done; printf '{{\"ticks\": {TICKS}}}' > result.json")

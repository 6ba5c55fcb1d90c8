"""20 concurrent short jobs through deferred operators (``make bench``)."""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG

from operators.slurm.operator import SlurmJobOperator

JOBS = int(os.environ.get("PP_BENCH_JOBS", "20"))
POLL = float(os.environ.get("PP_BENCH_POLL_S", "5"))

with DAG("bench_slurm_polling", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         max_active_tasks=JOBS):
    for i in range(JOBS):
        # Staggered lengths, so that ends spread over several polling rounds.
        SlurmJobOperator(task_id=f"job_{i:02d}", ssh_conn_id="slurm_local", poll_interval=POLL,
                         command=f"sleep {10 + (i * 7) % 23}")

"""Under a real ``airflow standalone`` (real triggerer): a 3-task array job's Airflow task log
has every task's lines, each once, prefixed with its task id. DAG: tests/dags/slurm_array_logs.py.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.airflow]


def test_array_task_log_has_every_tasks_lines(standalone) -> None:
    af = standalone
    run_id = af.trigger("slurm_array_logs")
    assert af.wait_run("slurm_array_logs", run_id, timeout=240) == "success"
    job = af.xcom("slurm_array_logs", run_id, "fanout", key="slurm_job")["job_id"]
    log = af.last_log("slurm_array_logs", run_id, "fanout")
    for task in range(3):
        for i in range(1, 5):
            # Old: task 0's lines only. Once each: no line forwarded twice.
            assert log.count(f"[slurm {job}_{task}] task {task} line {i}") == 1, (task, i, log)

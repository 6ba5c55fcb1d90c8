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
    # Every try's log: a try that Airflow's stale-event race failed (the DAG's retry) streamed
    # the lines, and its retry re-attached to the ended job. Across the tries, still each once.
    # The tries Airflow lists, not 1..try_number: CI met a number with no try behind it (404).
    tries = af.task_tries("slurm_array_logs", run_id, "fanout")
    logs = [af.task_log("slurm_array_logs", run_id, "fanout", try_number=n) for n in tries]
    log = "\n".join(logs)
    for task in range(3):
        for i in range(1, 5):
            # Old: task 0's lines only. Once each: no line forwarded twice.
            line = f"[slurm {job}_{task}] task {task} line {i}"
            assert log.count(line) == 1, f"{line!r} {log.count(line)} times in {tries} " \
                f"tries' logs:\n{log}"

"""A training segment that reaches its time limit without a checkpoint, under a real
``airflow standalone``: it must fail as "no progress" at once, never retry into a loop."""

from __future__ import annotations

import pytest

from tests.dags.campaign_faults import STUCK
from tests.support import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.airflow]


def test_time_limit_without_a_checkpoint_fails_as_no_progress(standalone) -> None:
    af = standalone
    cluster.remote(f"rm -rf {STUCK.cluster.remote_root}/{STUCK.name}")
    run_id = af.trigger("segment_no_progress")
    assert af.wait_run("segment_no_progress", run_id, timeout=400) == "failed"
    ti = af.task_instance("segment_no_progress", run_id, "segment_1")
    assert (ti["state"], ti["try_number"]) == ("failed", 1)  # retries=2, none used
    job = af.xcom("segment_no_progress", run_id, "segment_1", key="slurm_job")
    assert cluster.sacct_job(job["job_id"])["state"] == "TIMEOUT"
    log = af.task_log("segment_no_progress", run_id, "segment_1")
    assert "segment made no progress (iteration stayed at 0)" in log

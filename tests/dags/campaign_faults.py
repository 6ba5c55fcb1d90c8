"""Airflow DAGs for the campaign fault tests (tests/pipeline/test_segment_faults.py)."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from jobscripts.job_files import SEGMENT_RESULT
from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.schema.load import load_campaign
from operators.slurm.messages import JobRequest

_CI = load_campaign(Path(__file__).parents[1] / "campaigns" / "ci_campaign.yaml")
STUCK = _CI.model_copy(update={"name": "stuck_before_first_checkpoint"})


class StuckTrainer(TrainingSegmentOperator):
    """A trainer that hangs before its first checkpoint (data loading never returns) until
    Slurm ends it at its time limit: the real operator must see that nothing advanced."""

    def _require_data(self, data_path, origin) -> None:
        pass  # no dataset needed: this trainer never reads one

    def render_segment(self, inputs, history, train_iters) -> JobRequest:
        return JobRequest("echo 'loading the dataset...'; sleep 600",
                          {"time": "1", "partition": "debug", "requeue": True},
                          result_file=SEGMENT_RESULT)


with DAG("segment_no_progress", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         tags=["test"]):
    # Retries allowed: the point is that a segment without progress does not use them.
    StuckTrainer(task_id="segment_1", campaign=STUCK, segment=1, retries=2,
                 retry_delay=timedelta(seconds=1))

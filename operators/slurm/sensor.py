"""``SlurmJobSensor``: wait for a job that something else submitted."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator

from operators.slurm.errors import SlurmJobFailed
from operators.slurm.messages import TERMINAL, JobEvent
from operators.slurm.states import Outcome, classify
from operators.slurm.trigger import SlurmJobTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context


class SlurmJobSensor(BaseSensorOperator):
    """Succeeds when ``job_id`` completes; fails when it ends any other way."""

    template_fields = ("job_id",)

    def __init__(self, *, ssh_conn_id: str, job_id: str, deferrable: bool = True,
                 poll_interval: float = 5.0, **kwargs: Any) -> None:
        super().__init__(poke_interval=poll_interval, **kwargs)
        self.ssh_conn_id = ssh_conn_id
        self.job_id = job_id
        self.deferrable = deferrable
        self.poll_interval = poll_interval

    def _check(self, state: str, detail: str = "") -> bool:
        outcome = classify(state)
        if outcome.terminal and outcome is not Outcome.SUCCESS:
            raise SlurmJobFailed(f"Slurm job {self.job_id} ended {state} {detail}".rstrip())
        return outcome is Outcome.SUCCESS

    def poke(self, context: Context) -> bool:
        from operators.slurm.hook import SlurmHook  # paramiko: keep DAG parsing light

        record = SlurmHook(self.ssh_conn_id).describe(str(self.job_id))
        return record is not None and self._check(record.state, record.state_detail)

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        if self.poke(context):
            return None
        self.defer(trigger=SlurmJobTrigger(ssh_conn_id=self.ssh_conn_id, job_id=str(self.job_id),
                                           poll_interval=self.poll_interval),
                   method_name="execute_complete")

    def execute_complete(self, context: Context, event: dict[str, Any]) -> None:
        ended = JobEvent.from_json(event)
        if ended.status != TERMINAL:
            raise SlurmJobFailed(ended.message or "polling failed")
        self._check(ended.record.state, ended.record.state_detail)

"""A deferred task marked failed or cleared cancels its Slurm job through the trigger's
``on_kill``, even when the triggerer cancels ``on_kill`` itself.

Airflow 3.3's triggerer re-sends a trigger's cancel at each sync with its runner (about every
second) until the trigger finishes, and the runner cancels the trigger's task again: the second
cancel lands inside ``on_kill``. On a loaded CI machine that interrupted the SSH round trip
before ``scancel`` was sent, and the job ran on (tests/slurm/test_standalone.py's mark-failed
story timed out after 300 s). The cluster test cancels ``on_kill`` right after it starts, as
that second sync does, against a real job, sshd and Slurm.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from operators.slurm import poller as poller_module
from operators.slurm.errors import SlurmCommandError
from operators.slurm.jobkey import job_key
from operators.slurm.poller import ClusterPoller
from operators.slurm.trigger import SlurmJobTrigger
from tests.support import cluster


class FlakyCancelPoller(ClusterPoller):
    """A poller whose ``scancel`` fails ``failures`` times (slurmctld busy), then works."""

    def __init__(self, failures: int) -> None:
        super().__init__("unused", interval=0.01)
        self.failures = failures
        self.calls: list[tuple[str, str | None]] = []

    async def cancel(self, job_id: str, killed_in: str | None = None) -> None:
        self.calls.append((job_id, killed_in))
        if len(self.calls) <= self.failures:
            raise SlurmCommandError(f"scancel {job_id}", 1,
                                    "scancel: error: Socket timed out on send/recv operation")


def test_a_kill_cancel_that_fails_is_retried_until_scancel_answers(caplog) -> None:
    caplog.set_level(logging.INFO, logger=poller_module.__name__)
    poller = FlakyCancelPoller(failures=2)

    async def scenario() -> None:
        first = poller.cancel_for_kill("7", "/runs/k")
        assert poller.cancel_for_kill("7", "/runs/k") is first  # one cancel per job at a time
        await first

    asyncio.run(scenario())
    assert poller.calls == [("7", "/runs/k")] * 3
    said = [r.getMessage() for r in caplog.records]
    assert sum("retrying: scancel exited 1: scancel: error: Socket timed out" in m
               for m in said) == 2, said
    assert "Slurm job 7 cancelled: its task was killed" in said


def test_a_kill_cancel_gives_up_at_its_deadline_and_says_so(caplog, monkeypatch) -> None:
    monkeypatch.setattr(poller_module, "KILL_CANCEL_RETRY_S", 0.05)
    poller = FlakyCancelPoller(failures=10**6)

    async def scenario() -> None:
        await asyncio.wait_for(poller.cancel_for_kill("8"), timeout=10)

    asyncio.run(scenario())
    assert len(poller.calls) >= 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "Slurm job 8 of a killed task could not be cancelled" in errors[-1]


@pytest.mark.cluster
def test_on_kill_cancelled_by_the_triggerers_next_sync_still_cancels_the_job(hook) -> None:
    from operators.slurm.spec import JobSpec

    key = job_key("triggerkill", uuid.uuid4().hex, "t")
    run_dir = hook.run_dir(key)
    spec = JobSpec(name=key, comment=key, workdir=run_dir, time="5",
                   output=f"{run_dir}/slurm-%j.out", command="sleep 300").validate()
    job_id = hook.submit(spec, run_dir)

    async def scenario() -> str:
        trigger = SlurmJobTrigger(cluster.CONN_ID, job_id, log_path=f"{run_dir}/slurm-{job_id}.out",
                                  poll_interval=1.0, job_name=key)
        trigger._log = logging.getLogger("tests.slurm.trigger_kill")
        killing = asyncio.ensure_future(trigger.on_kill())
        await asyncio.sleep(0)  # on_kill has started: its SSH connection is being opened
        killing.cancel("the triggerer's next sync")
        with pytest.raises(asyncio.CancelledError):
            await killing
        # The triggerer's event loop runs on; so does this one, until Slurm answers.
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:
            state = (await asyncio.to_thread(cluster.sacct_job, job_id))["state"]
            if state.startswith("CANCELLED"):
                break
            await asyncio.sleep(1)
        await ClusterPoller.get(cluster.CONN_ID, 1.0)._drop()
        return state

    try:
        state = asyncio.run(scenario())
    finally:
        hook.cancel(job_id)
    assert state.startswith("CANCELLED"), state
    assert job_id in hook.killed_jobs(run_dir)  # noted as a kill's cancel, for the next try

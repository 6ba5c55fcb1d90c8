"""The log watch on the local cluster: the real ``SlurmJobTrigger`` and ``ClusterPoller`` (one
SSH connection) watching two real jobs that log Megatron iteration lines
(jobscripts/megatron_log.py's exact text) and then hang. The hang watchdog (4 s timeout) must
SIGTERM both over the poller's connection; the job that traps SIGTERM exits by itself, the one
that ignores it is cancelled after the grace period. Both triggers fire their terminal event
with the hang finding, and the stopped jobs are noted in their run dirs.

Detection time (the hang's start, as the job printed it, to the finding) is measured, not
asserted: printed, and appended to $PP_HANG_FIGURES when set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import posixpath
import shlex
import uuid

import pytest

from jobscripts import megatron_log as ml
from operators.slurm.commands import STOPPED_JOBS
from operators.slurm.jobkey import job_key
from operators.slurm.poller import ClusterPoller
from operators.slurm.trigger import SlurmJobTrigger
from operators.slurm.watch import LogFinding, LogWatch
from operators.tracking.hang import HangWatch
from tests.support import cluster

TIMEOUT_S, GRACE_S, POLL_S = 4.0, 5.0, 1.0
HANG_AT = 3
# After the iteration lines: the hang. "trap": SIGTERM ends it (a trainer that saves and
# exits); "ignore": SIGTERM is ignored by the shell and its children (a rank stuck in a
# collective), so only the cancel (SIGKILL after Slurm's KillWait) ends it.
HANGS = {
    "trap": "trap 'echo got SIGTERM; exit 0' TERM; while true; do sleep 0.2; done",
    "ignore": "trap '' TERM; while true; do sleep 0.2; done",
}


def _command(hang: str) -> str:
    lines = []
    for i in range(1, HANG_AT + 1):
        lines += [ml.throughput_line(0.3, 0.01),
                  ml.iteration_line(i, 12, i * 8, 300.0, 1e-3, 8, 5.0 - i / 10, 1.0, 0, 0)]
    echo = "; ".join(f"echo {shlex.quote(line)}; sleep 0.3" for line in lines)
    return f'{echo}; echo "HANG_START $(date +%s.%N)"; {hang}'


def _logged(trigger: SlurmJobTrigger) -> SlurmJobTrigger:
    trigger._log = logging.getLogger("tests.slurm.log_watch")  # caplog sees it
    return trigger


def test_a_hung_job_is_stopped_through_the_triggers_log_stream(hook, caplog) -> None:
    from operators.slurm.spec import JobSpec

    caplog.set_level(logging.INFO)
    jobs = {}
    for name, hang in HANGS.items():
        key = job_key("logwatch", uuid.uuid4().hex, name)
        run_dir = hook.run_dir(key)
        spec = JobSpec(name=key, comment=key, workdir=run_dir, time="5",
                       output=posixpath.join(run_dir, "slurm-%j.out"),
                       command=_command(hang)).validate()
        jobs[name] = (hook.submit(spec, run_dir), key, run_dir)

    async def scenario() -> tuple[dict, int]:
        def trigger(job_id: str, key: str, run_dir: str) -> SlurmJobTrigger:
            watch = LogWatch((HangWatch.spec(startup_s=60.0, timeout_s=TIMEOUT_S,
                                             grace_s=GRACE_S, start_iteration=0),))
            return _logged(SlurmJobTrigger(
                cluster.CONN_ID, job_id, log_path=posixpath.join(run_dir, f"slurm-{job_id}.out"),
                poll_interval=POLL_S, job_name=key, watch=watch.to_json()))
        events = await asyncio.wait_for(asyncio.gather(
            *(anext(trigger(*job).run()) for job in jobs.values())), timeout=240)
        poller = ClusterPoller.get(cluster.CONN_ID, POLL_S)
        opened = poller.stats.connections_opened
        await poller._drop()
        return dict(zip(jobs, (e.payload for e in events), strict=True)), opened

    try:
        payloads, opened = asyncio.run(scenario())
    finally:
        for job_id, _, _ in jobs.values():
            hook.cancel(job_id)
    assert opened == 1  # both jobs watched, signalled and cancelled on one SSH connection
    messages = [r.getMessage() for r in caplog.records]
    for record in caplog.records:  # the timeline, for the report
        if record.getMessage().startswith("Slurm job"):
            print(f"{record.created:.2f}", record.getMessage()[:100])
    for name, (job_id, _, run_dir) in jobs.items():
        payload = payloads[name]
        assert payload["status"] == "terminal", payload
        (finding,) = (LogFinding.from_json(f) for f in payload["findings"])
        assert (finding.code, finding.iteration, finding.stop_job) == ("hang", HANG_AT, True)
        assert finding.reason.startswith(f"no progress for 0.1 min at iteration {HANG_AT} ")
        assert f"Slurm job {job_id}: SIGTERM sent (log watch: no progress" in " ".join(messages)
        assert job_id in hook.read_bytes(posixpath.join(run_dir, STOPPED_JOBS)).decode().split()
        log = hook.read_bytes(posixpath.join(run_dir, f"slurm-{job_id}.out")).decode()
        cancelled = any(m.startswith(f"Slurm job {job_id}: cancelled") for m in messages)
        state = cluster.sacct_job(job_id)["state"]
        if name == "trap":
            assert "got SIGTERM" in log and not cancelled and state == "COMPLETED", (log, state)
        else:
            assert "got SIGTERM" not in log and cancelled, log
            assert state.startswith("CANCELLED"), state  # "CANCELLED by <uid>"
        hang_start = float(log.split("HANG_START ", 1)[1].split()[0])
        figures = {"job": name, "hang_detect_s": round(finding.at - hang_start, 2),
                   "hang_timeout_s": TIMEOUT_S, "poll_interval_s": POLL_S}
        print(json.dumps(figures))
        if os.environ.get("PP_HANG_FIGURES"):
            with open(os.environ["PP_HANG_FIGURES"], "a") as out:
                out.write(json.dumps(figures) + "\n")


@pytest.fixture(autouse=True)
def _fresh_pollers():
    """asyncio.run makes a new loop per test: no poller of an earlier loop may be reused."""
    yield
    ClusterPoller._pollers.clear()


def test_the_workers_own_wait_runs_the_same_watchers(hook, caplog) -> None:
    """``deferrable=False``: the operator's blocking wait feeds the same LogWatch and stops the
    job through the worker's hook."""
    from operators.slurm.operator import SlurmJobOperator
    from operators.slurm.spec import JobSpec

    caplog.set_level(logging.INFO)
    key = job_key("logwatch", uuid.uuid4().hex, "worker")
    run_dir = hook.run_dir(key)
    spec = JobSpec(name=key, comment=key, workdir=run_dir, time="5",
                   output=posixpath.join(run_dir, "slurm-%j.out"),
                   command=_command(HANGS["trap"])).validate()
    job_id = hook.submit(spec, run_dir)
    operator = SlurmJobOperator(task_id="wait_here", ssh_conn_id=cluster.CONN_ID,
                                command="true", deferrable=False, poll_interval=POLL_S)
    watch = LogWatch((HangWatch.spec(startup_s=60.0, timeout_s=TIMEOUT_S, grace_s=GRACE_S,
                                     start_iteration=0),))
    try:
        event = operator._wait_in_worker(job_id, posixpath.join(run_dir, f"slurm-{job_id}.out"),
                                         key, watch)
    finally:
        hook.cancel(job_id)
    assert event.status == "terminal" and event.record.state == "COMPLETED", event
    (finding,) = event.findings
    assert finding.code == "hang" and finding.iteration == HANG_AT
    assert "got SIGTERM" in hook.read_bytes(posixpath.join(run_dir, f"slurm-{job_id}.out")).decode()
    assert job_id in hook.read_bytes(posixpath.join(run_dir, STOPPED_JOBS)).decode().split()

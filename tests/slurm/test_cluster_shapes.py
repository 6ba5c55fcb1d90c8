"""Job arrays, het jobs (on two nodes), a login banner and an accounting outage on the real
local cluster, through the worker's hook and the triggerer's poller (no Airflow: fast, and
their counters are readable).

The banner and outage tests change the cluster for everyone: run this file under
``flock -x /tmp/pp-cluster.lock``. Each restores the cluster in ``finally``.
"""

from __future__ import annotations

import asyncio
import posixpath
import time
import uuid

import pytest

from operators.slurm.hook import SlurmHook
from operators.slurm.jobkey import job_key
from operators.slurm.poller import ClusterPoller
from operators.slurm.spec import JobSpec
from operators.slurm.states import Outcome, classify
from tests.support import cluster

CONN = cluster.CONN_ID



def submit(hook: SlurmHook, command: str, **job) -> tuple[str, str, str]:
    """(key, run dir, job id) of a fresh job."""
    key = job_key("shapes", uuid.uuid4().hex, "t")
    run_dir = hook.run_dir(key)
    log = "slurm-%A_%a.out" if job.get("array") else "slurm-%j.out"
    spec = JobSpec(name=key, comment=key, command=command, workdir=run_dir,
                   output=posixpath.join(run_dir, log), time="5", **job).validate()
    return key, run_dir, hook.submit(spec, run_dir)


def wait_terminal(hook: SlurmHook, job_id: str, key: str, timeout: float = 90):
    return cluster.wait_job_end(hook, job_id, key, timeout)


def test_array_with_one_failed_task_is_a_failure_naming_it(hook) -> None:
    key, _, job_id = submit(hook, 'sleep 2; [ "$SLURM_ARRAY_TASK_ID" != 1 ] || exit 7',
                            array="0-2")
    record = wait_terminal(hook, job_id, key)
    assert (record.job_id, record.state, record.exit_code) == (job_id, "FAILED", 7)
    assert f"{job_id}_1 FAILED exit code 7" in record.state_detail
    assert f"{job_id}_0" not in record.state_detail and f"{job_id}_2" not in record.state_detail
    # The key lookup that decides re-attach-or-submit sees the array, not its highest task.
    found = hook.find_by_key(key)
    assert (found.job_id, classify(found.state)) == (job_id, Outcome.FAILURE)


def test_pending_array_task_is_found_by_its_own_id(hook) -> None:
    _, _, blocker = submit(hook, "sleep 60")
    _, _, job_id = submit(hook, "true", array="2-4%25", dependency=f"afterok:{blocker}")
    try:
        # sacct --jobs=ID_3 prints nothing for a task pending inside a range (local 22.05.8)
        assert cluster.wait_for(lambda: hook.describe(f"{job_id}_3"), 20, "task 3").state == (
            "PENDING")  # old: None (the range row `ID_[2-4%25]` was not searched)
        assert hook.describe(job_id).state == "PENDING"
        assert hook.describe(f"{job_id}_5") is None
    finally:
        hook.cancel(blocker)
        hook.cancel(job_id)


# A launcher (component 0, where the batch script runs) and a worker (component 1) with its
# own resources (Slurm 22.05 `#SBATCH hetjob`, sbatch(1) "HETEROGENEOUS JOB SUPPORT").
LAUNCHER = {"cpus_per_task": 1, "mem": "100M"}
WORKER = {"cpus_per_task": 2, "mem": "100M"}


def test_het_job_runs_its_components_on_two_nodes_followed_by_its_leader_id(hook) -> None:
    # One srun step over both components: each prints the node it runs on. The sleep keeps
    # the job in squeue long enough to read its rows there.
    key, run_dir, job_id = submit(
        hook, "sleep 3; srun --het-group=0,1 bash -c 'echo ran-on $(hostname)'",
        het_components=[WORKER], **LAUNCHER)
    script = hook.read_bytes(posixpath.join(run_dir, "job.sbatch")).decode()
    assert "#SBATCH hetjob\n#SBATCH --cpus-per-task=2\n" in script
    try:
        rows = cluster.remote(f"squeue --noheader --jobs={job_id} --format=%i").split()
        assert rows == [f"{job_id}+0", f"{job_id}+1"]  # never the id sbatch printed
        assert hook.describe(job_id).state in ("PENDING", "RUNNING")  # old: None
        assert hook.find_by_key(key).job_id == job_id
        record = wait_terminal(hook, job_id, key)
    finally:
        hook.cancel(job_id)
    assert (record.job_id, record.state, record.exit_code) == (job_id, "COMPLETED", 0)
    log = hook.log_tail(posixpath.join(run_dir, f"slurm-{job_id}.out"))
    ran_on = sorted(line.split()[1] for line in log.splitlines() if line.startswith("ran-on "))
    components = [cluster.sacct_field(f"{job_id}+{i}", "NodeList") for i in (0, 1)]
    # The launcher and the worker each got a node of their own, and the step ran on both.
    assert len(set(components)) == 2 and ran_on == sorted(components), (components, log)
    assert record.nodelist == ",".join(sorted(components))


def test_het_job_whose_worker_fails_is_a_failure_naming_the_worker(hook) -> None:
    # The worker's step exits 5; the launcher's script fails with it (set -e), as a launcher
    # whose workers died must. sacct then records both components FAILED 5:0 (local 22.05.8).
    key, _, job_id = submit(hook, "srun --het-group=1 bash -c 'exit 5'",
                            het_components=[WORKER], **LAUNCHER)
    record = wait_terminal(hook, job_id, key)
    assert (record.job_id, record.state, record.exit_code) == (job_id, "FAILED", 5)
    assert classify(record.state) is Outcome.FAILURE
    assert f"{job_id}+1 FAILED exit code 5" in record.state_detail
    found = hook.find_by_key(key)  # what decides re-attach-or-submit on a retry
    assert (found.job_id, classify(found.state)) == (job_id, Outcome.FAILURE)


@pytest.mark.disruptive
def test_login_banner_on_every_command(hook) -> None:
    # The site also sets relative times for its users: our queries must not inherit it.
    with cluster.login_banner("export SLURM_TIME_FORMAT=relative") as banner:
        assert banner in hook.run("true")[1]  # the shell really prints it, per command
        key, run_dir, job_id = submit(hook, "echo streamed-line; sleep 1")
        assert hook.find_by_key(key).job_id == job_id  # old: SlurmParseError before sbatch
        record = wait_terminal(hook, job_id, key)
        assert record.state == "COMPLETED" and record.start is not None  # standard times
        assert hook.node_count() == len(cluster.node_names())  # through the banner
        assert "streamed-line" in hook.log_tail(posixpath.join(run_dir, f"slurm-{job_id}.out"))

        async def one_round() -> tuple[object, bytes]:
            poller = ClusterPoller(CONN, 1.0)
            try:
                found = await poller._query([job_id])
                log = await poller.read_bytes(posixpath.join(run_dir, f"slurm-{job_id}.out"))
                return found, log
            finally:
                await poller._drop()
        found, log = asyncio.run(one_round())
        assert found.records[job_id].state == "COMPLETED" and found.skipped
        assert b"streamed-line" in log


OUTAGE_S = 20.0  # with 1 s rounds: ~20 failed sacct calls (see test_accounting_outage...)
INTERVAL_S = 1.0


@pytest.mark.disruptive
def test_accounting_outage_follows_the_job_through_squeue_on_one_connection(hook) -> None:
    """slurmdbd stopped while a job runs: the poller keeps one SSH connection, follows the
    job through squeue every round, and sees sacct again within two intervals.

    The old poller reconnected after every failed round with a back-off growing to 60 s.
    What that costs is set by the number of failed rounds, not by the wall time: 20 rounds
    of 1 s show it (the issue saw 7 connections in 2 minutes of 5 s rounds).
    """
    _, _, job_id = submit(hook, "for i in $(seq 60); do echo tick $i; sleep 1; done")
    cluster.wait_for(lambda: (r := hook.describe(job_id)) and r.state == "RUNNING", 60,
                     "the job to run")

    async def scenario() -> dict:
        poller = ClusterPoller(CONN, INTERVAL_S)
        poller.watch(job_id)
        seen: dict = {"during": [], "recovered_after": None}
        try:
            snap = await poller.wait(0)
            assert snap.records[job_id].state == "RUNNING" and snap.error is None
            await asyncio.to_thread(cluster.stop_slurmdbd)
            try:
                deadline = time.monotonic() + OUTAGE_S
                while time.monotonic() < deadline:
                    snap = await poller.wait(snap.seq)
                    seen["during"].append((snap.records.get(job_id), snap.error))
            finally:
                await asyncio.to_thread(cluster.restart_cluster_services)
            back = time.monotonic()
            while snap.error is not None:
                snap = await poller.wait(snap.seq)
            seen["recovered_after"] = time.monotonic() - back
            seen["stats"] = poller.stats
        finally:
            poller.unwatch(job_id)
            await poller._drop()
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        hook.cancel(job_id)
    during = seen["during"]
    print(f"outage {OUTAGE_S}s: {len(during)} rounds, stats {seen['stats']}, "
          f"recovered {seen['recovered_after']:.2f}s after slurmdbd was back")
    assert len(during) >= OUTAGE_S / INTERVAL_S * 0.6
    assert all(error and "sacct exited" in error for _, error in during[1:])
    assert all(r is not None and r.state == "RUNNING" and r.source == "squeue"
               for r, _ in during)  # old: no record at all (unknown) every round
    stats = seen["stats"]
    assert stats.connections_opened == 1  # old: one more per failed round
    assert stats.failed_rounds == 0 and stats.degraded_rounds >= len(during) - 1
    assert seen["recovered_after"] <= 2 * INTERVAL_S + 1.0  # old back-off: up to 60 s


@pytest.mark.disruptive
@pytest.mark.parametrize("wrapper", [
    # A site's wrapper that prints sbatch's normal line, naming the cluster (sbatch.c).
    'sbatch() { id=$(command sbatch "$@") && echo "sbatch: Submitted batch job ${id%%;*} '
    'on cluster pp-local"; }',
    # One that swallows the id: sbatch exited 0, so the job exists; found by its key.
    'sbatch() { command sbatch "$@" > /dev/null && echo "your job is queued"; }',
])
def test_wrapped_sbatch(hook, wrapper: str) -> None:
    with cluster.login_banner(wrapper):
        assert "sbatch is a function" in hook.run("type sbatch")[1]  # the wrapper is in effect
        key, _, job_id = submit(hook, "true")
    record = wait_terminal(hook, job_id, key)  # old: SlurmParseError after the job queued
    assert record.state == "COMPLETED" and hook.find_by_key(key).job_id == job_id

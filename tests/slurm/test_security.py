"""Host keys are checked, authentication failures are named, bad specs never reach SSH."""

from __future__ import annotations

import asyncio
import json

import pytest

from operators.slurm.errors import ClusterAuthError
from operators.slurm.operator import SlurmJobOperator
from operators.slurm.spec import JobSpecError
from tests.support import cluster

pytestmark = pytest.mark.cluster
OTHER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOQ2h3h3b0dI8I0n1H2dd5aX6Jk3n6a0p5s1m6W4kZ3W"


def _conn(monkeypatch, conn_id: str, **changes) -> None:
    conn = cluster.connection()
    extra = {**conn["extra"], **changes.pop("extra", {})}
    for key, value in list(extra.items()):
        if value is None:
            del extra[key]
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({**conn, **changes,
                                                                      "extra": extra}))
    monkeypatch.setenv("HOME", "/nonexistent-home")  # no ~/.ssh/known_hosts to fall back on


def test_pinned_host_key_is_accepted(local_cluster, monkeypatch) -> None:
    from operators.slurm.hook import SlurmHook

    _conn(monkeypatch, "good")
    assert SlurmHook("good").run("echo ok") == (0, "ok\n", "")


@pytest.mark.parametrize("extra", [{"host_key": OTHER_KEY}, {"host_key": None}],
                         ids=["changed-host-key", "unknown-host-key"])
def test_wrong_or_unknown_host_key_is_refused(local_cluster, monkeypatch, extra) -> None:
    from operators.slurm.hook import SlurmHook

    _conn(monkeypatch, "badkey", extra=extra)
    with pytest.raises(ClusterAuthError, match="host key"):
        SlurmHook("badkey").run("echo should-not-run")


@pytest.mark.parametrize("extra", [{"host_key": OTHER_KEY}, {"host_key": None}],
                         ids=["changed-host-key", "unknown-host-key"])
def test_trigger_side_refuses_wrong_host_key_too(local_cluster, monkeypatch, extra) -> None:
    import asyncssh

    from operators.slurm.poller import ClusterPoller

    _conn(monkeypatch, "badkey_async", extra=extra)

    async def connect():
        return await ClusterPoller("badkey_async", 1).run("echo should-not-run")

    with pytest.raises((asyncssh.HostKeyNotVerifiable, asyncssh.KeyExchangeFailed,
                        asyncssh.PermissionDenied, asyncssh.DisconnectError)):
        asyncio.run(connect())


def test_auth_failure_names_host_user_and_key(local_cluster, monkeypatch, tmp_path) -> None:
    from operators.slurm.hook import SlurmHook

    stranger = tmp_path / "stranger"
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)],
                   check=True)
    _conn(monkeypatch, "stranger", extra={"key_file": str(stranger)})
    with pytest.raises(ClusterAuthError) as err:
        SlurmHook("stranger").run("true")
    message = str(err.value)
    assert "127.0.0.1" in message and "pretrain" in message and str(stranger) in message
    assert stranger.read_text() not in message  # the path, never the key


@pytest.mark.parametrize(("job", "field"), [
    ({"partition": "gpu\n#SBATCH --uid=0"}, "partition"),
    ({"time": "1:00; rm -rf ~"}, "time"),
    ({"nodes": 0}, "nodes"),
    ({"account": "$(whoami)"}, "account"),
])
def test_invalid_spec_fails_at_parse_time_before_any_ssh(job, field) -> None:
    # No connection "nowhere" exists: reaching SSH would fail differently.
    with pytest.raises(JobSpecError) as err:
        SlurmJobOperator(task_id="t", ssh_conn_id="nowhere", command="true", job=job)
    assert err.value.field_name == field


def test_unknown_job_option_is_named() -> None:
    with pytest.raises(ValueError, match="gpus_per_nodes"):
        SlurmJobOperator(task_id="t", ssh_conn_id="nowhere", command="true",
                         job={"gpus_per_nodes": "4"})

"""The local cluster as the tests see it: its Airflow connection and ``sacct``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("PP_CLUSTER_STATE", "/var/lib/pretrain-cluster"))
CONN_ID = "slurm_local"
CLUSTER_SCRIPT = REPO / "docker" / "local_cluster.sh"


class ClusterNotUp(RuntimeError):
    pass


def connection_env() -> dict[str, str]:
    """``AIRFLOW_CONN_SLURM_LOCAL`` as ``local_cluster.sh up`` wrote it."""
    env_file = STATE / "airflow.env"
    if not env_file.exists():
        raise ClusterNotUp(f"{env_file} missing: run `make cluster-up` first")
    match = re.search(r"AIRFLOW_CONN_SLURM_LOCAL='(.*)'", env_file.read_text())
    if not match:
        raise ClusterNotUp(f"{env_file} holds no AIRFLOW_CONN_SLURM_LOCAL")
    return {"AIRFLOW_CONN_SLURM_LOCAL": match.group(1)}


def connection() -> dict:
    return json.loads(connection_env()["AIRFLOW_CONN_SLURM_LOCAL"])


def check_up() -> None:
    proc = subprocess.run(["bash", str(CLUSTER_SCRIPT), "status"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterNotUp(
            f"local cluster is not up (make cluster-up):\n{proc.stdout}{proc.stderr}")


def sacct_by_name(name: str) -> list[dict[str, str]]:
    """Every allocation row ``sacct`` has for jobs named ``name`` (duplicates included)."""
    out = subprocess.run(
        ["sacct", "--parsable2", "--noheader", "--allusers", "--duplicates", "-X",
         "--starttime=now-1days", f"--name={name}", "--format=JobID,JobName,State,ExitCode"],
        capture_output=True, text=True, check=True).stdout
    rows = [dict(zip(("id", "name", "state", "exit"), line.split("|"), strict=True))
            for line in out.splitlines() if line.strip()]
    return [r for r in rows if r["name"] == name]


def sacct_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "--parsable2", "--noheader", "-X", f"--jobs={job_id}",
                          "--format=JobID,JobName,State,ExitCode"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    if not lines:  # sacct learns of a new job a few seconds after sbatch: not known yet
        return {"id": job_id, "name": "", "state": "", "exit": ""}
    return dict(zip(("id", "name", "state", "exit"), lines[0].split("|"), strict=True))


def sacct_field(job_id: str, field: str) -> str:
    return subprocess.run(["sacct", "--parsable2", "--noheader", "-X", f"--jobs={job_id}",
                           f"--format={field}"], capture_output=True, text=True,
                          check=True).stdout.strip()


def address_for_jobs() -> str:
    """The address of this machine that jobs on the cluster's nodes reach (each node has a
    network namespace of its own, and its own 127.0.0.1): the controller's address in
    slurm.conf, the bridge's; 127.0.0.1 when the cluster has none up here."""
    try:
        conf = Path("/etc/slurm/slurm.conf").read_text()
    except OSError:
        return "127.0.0.1"
    match = re.search(r"^SlurmctldHost=[^(\s]+\(([0-9.]+)\)", conf, re.M)
    if not match:
        return "127.0.0.1"
    with socket.socket() as probe:  # the bridge exists only while the cluster is up
        try:
            probe.bind((match.group(1), 0))
        except OSError:
            return "127.0.0.1"
    return match.group(1)


def port_open_on_nodes(port: int) -> list[str]:
    """The nodes on which something listens on 127.0.0.1:``port`` (each node's own)."""
    open_on = []
    for node in node_names():
        probe = subprocess.run(["nsenter", f"--net=/run/netns/{node}", "bash", "-c",
                                f": </dev/tcp/127.0.0.1/{port}"], capture_output=True)
        if probe.returncode == 0:
            open_on.append(node)
    return open_on


# The partition of the nodes only the node-failure stories use (docker/local_cluster.sh:
# PP_CLUSTER_FAULT_NODES): they set them down and cut their links while the rest of the suite
# runs on the others.
FAULT_PARTITION = "faults"


def _node_number(name: str) -> int:
    return int(name.removeprefix("node"))


def partition_nodes(partition: str) -> list[str]:
    """The nodes of ``partition``, in number order (node4, node5, ...)."""
    out = subprocess.run(["sinfo", "--noheader", "--Node", f"--partition={partition}",
                          "--format=%N"], capture_output=True, text=True, check=True).stdout
    return sorted(set(out.split()), key=_node_number)


def hostlist(*names: str) -> str:
    """Slurm's compressed host list of ``names`` as sacct and squeue print it: node[4-5],
    node[4,6], node5."""
    numbers = sorted(_node_number(name) for name in names)
    if len(numbers) == 1:
        return f"node{numbers[0]}"
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    return f"node[{','.join(parts)}]"


def node_names() -> list[str]:
    """The cluster's compute nodes, as ``sinfo`` lists them (node1, node2, ...)."""
    out = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N"], capture_output=True,
                         text=True, check=True).stdout
    return sorted(set(out.split()))


def wait_for(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_job_end(hook, job_id: str, key: str, timeout: float = 90):
    """The job's record once sacct (not squeue alone) says it ended."""
    from operators.slurm.states import classify

    def ended():
        record = hook.describe(job_id, name=key)
        if record and record.source == "sacct" and classify(record.state).terminal:
            return record
        return None
    return wait_for(ended, timeout, f"job {job_id} to end")


def sshd_pid() -> int:
    return int((STATE / "pids" / "sshd.pid").read_text().strip())


def drop_sshd() -> None:
    """Kill sshd and every session it holds: established connections break too."""
    pid = sshd_pid()
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    os.kill(pid, signal.SIGTERM)
    for child in children.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)


def restart_cluster_services() -> None:
    subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], check=True, capture_output=True)


def remote(command: str) -> str:
    """Run ``command`` as the cluster user over the real sshd."""
    conn = connection()
    extra = conn["extra"]
    argv = ["ssh", "-i", extra["key_file"], "-p", str(conn["port"]),
            "-o", f"UserKnownHostsFile={STATE / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", f"{conn['login']}@{conn['host']}", command]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout




def stop_slurmdbd() -> None:
    """Stop the accounting daemon (sacct then fails as on a site whose slurmdbd is down);
    ``restart_cluster_services`` starts it again. Disrupts the cluster: flock -x."""
    pid = int((STATE / "pids" / "slurmdbd.pid").read_text().strip())
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, "slurmdbd to stop", 0.2)


BASHRC = Path("/home/pretrain/.bashrc")
BANNER = "=== Welcome to pp-local: maintenance Tue 08:00-12:00, quota 93% full | see /etc/motd ==="


@contextlib.contextmanager
def login_banner(extra: str = ""):
    """The cluster user's shell prints ``BANNER`` on stdout for every command run over SSH
    (and runs ``extra``), as login nodes do; the shell file is restored afterwards.
    Disrupts the cluster: flock -x."""
    original = BASHRC.read_bytes()
    stat = BASHRC.stat()
    try:
        # Before Debian's "not interactive: return", so that `ssh host cmd` prints it too.
        BASHRC.write_bytes(f"echo {BANNER!r}\n{extra}\n".encode() + original)
        os.chown(BASHRC, stat.st_uid, stat.st_gid)
        yield BANNER
    finally:
        BASHRC.write_bytes(original)
        os.chown(BASHRC, stat.st_uid, stat.st_gid)


def read_local_bytes(path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
    """Up to ``limit`` bytes of a file on this machine from ``offset``, b"" when it does not
    exist: what ``ClusterPoller.read_bytes`` answers, for the test pollers that stand in for it
    on local files."""
    file = Path(path)
    if not file.exists():
        return b""
    with file.open("rb") as handle:
        handle.seek(offset)
        return handle.read(limit)

"""The cluster's ``faults`` partition (docker/local_cluster.sh: PP_CLUSTER_FAULT_NODES), where
the multi-node failure stories set nodes down, cut their links and kill ranks
(tests/trainer/test_multinode_faults.py through the worker's SlurmHook,
tests/pipeline/test_multinode_faults_airflow.py under a real triggerer). No other test names
it, so those stories run beside the rest of the suite (tests/lanes.py)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support import cluster

# The fault the stories inject: the reference trainer hangs after iteration 3 (its
# checkpoint is at 2) until a signal, which it honours by saving (jobscripts/trainer_faults.py).
HANG_AT = 3
HANG = {"hang": {"at_iteration": HANG_AT, "signals": True}}
HANG_LINE = f"TEST FAULT: hanging after iteration {HANG_AT}"
DOWN_REASON = "pp-test-node-down"


@dataclass(frozen=True)
class FaultNodes:
    """The fault partition's three nodes in order: a 2-node job on ``a`` and ``b`` has its
    rank 0 (the rendezvous host) on ``a``; ``c`` is where a requeue or a retry goes."""

    a: str
    b: str
    c: str

    def veth(self, node: str) -> str:
        """The node's link on the bridge (local_cluster.sh: pp-vethI for nodeI)."""
        return f"pp-veth{node.removeprefix('node')}"

    def resume_all(self) -> None:
        for node in (self.a, self.b, self.c):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                           capture_output=True)


def the_fault_nodes() -> FaultNodes:
    found = cluster.partition_nodes(cluster.FAULT_PARTITION)
    assert len(found) >= 3, (f"the {cluster.FAULT_PARTITION} partition has {found}: "
                             "docker/local_cluster.sh up with PP_CLUSTER_FAULT_NODES=3")
    return FaultNodes(*found[:3])


def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True,
                          check=True).stdout


def set_node_down(node: str) -> None:
    """An admin's DOWN: the node's slurmd lives on, so Slurm signals the job's steps there."""
    scontrol("update", f"nodename={node}", "state=down", f"reason={DOWN_REASON}")


def job_field(job_id: str, name: str) -> str:
    for word in scontrol("show", "job", job_id).split():
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"scontrol show job {job_id} has no {name}")


@contextlib.contextmanager
def held(node: str) -> Iterator[None]:
    """``node`` taken whole by a sleeping job while the block runs: it steers a 2-node job
    onto the other two without ``--exclude`` or ``--nodelist``, which a requeued job keeps
    (its requeue must be free to go to ``node``)."""
    job_id = cluster.remote(f"sbatch --parsable --exclusive --nodelist={node} "
                            f"--partition={cluster.FAULT_PARTITION} --job-name=pp-hold "
                            "--output=/dev/null --wrap 'sleep 900'").strip()
    try:
        cluster.wait_for(lambda: cluster.remote(f"squeue -h -j {job_id} -o %T").strip()
                         == "RUNNING", 120, f"{node} held by job {job_id}")
        yield
    finally:
        cluster.remote(f"scancel {job_id}")


def trainer_pid(job_id: str, node_rank: int) -> int:
    """The trainer process of ``job_id`` with that node rank: found by its environment (the
    nodes share this machine's PID namespace), never by a name."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_NODEID={node_rank}".encode()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if b"jobscripts.reference_trainer" in cmdline and b"torch.distributed.run" not in \
                cmdline and wanted <= environ:
            return int(proc.name)
    raise AssertionError(f"no trainer of job {job_id} at node rank {node_rank}")

"""``docker/local_cluster.sh down`` removes what ``up`` made even while a process still holds a
node's network namespace (a job's orphan, as after a node loss), and ``up`` then brings the
same cluster back (issue 16, part 1: "cleans up its namespaces").

Disruptive: the whole cluster goes down for a few seconds; ``finally`` brings it up.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.support import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.disruptive]

BRIDGE = "pp-br0"


def links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_down_removes_namespaces_veths_and_bridge_though_a_process_holds_one(local_cluster):
    nodes = cluster.node_names()
    assert {f"pp-veth{n.removeprefix('node')}" for n in nodes} | {BRIDGE} <= links()
    # An orphan inside node1's namespace: the namespace outlives `ip netns del` while it runs.
    orphan = subprocess.Popen(["nsenter", f"--net=/run/netns/{nodes[0]}", "sleep", "600"])
    try:
        time.sleep(0.5)
        subprocess.run(["bash", str(cluster.CLUSTER_SCRIPT), "down"], check=True,
                       capture_output=True)
        left = links()
        assert not {name for name in left if name.startswith("pp-")}, left
        assert not set(nodes) & namespaces()
        assert orphan.poll() is None  # down stops only what it started
        status = subprocess.run(["bash", str(cluster.CLUSTER_SCRIPT), "status"],
                                capture_output=True, text=True)
        assert status.returncode != 0
    finally:
        orphan.kill()
        orphan.wait()
        cluster.restart_cluster_services()
    assert cluster.node_names() == nodes
    assert {f"pp-veth{n.removeprefix('node')}" for n in nodes} | {BRIDGE} <= links()
    # Every node answers a job step again: the default partition's and the fault partition's
    # (which only exists when the cluster has fault nodes).
    answered = []
    for partition in sorted(set(cluster.remote("sinfo -h -o %R").split())):
        count = cluster.remote(f"sinfo -h -p {partition} -o %D").split()
        answered += cluster.remote(
            f"srun -p {partition} -N{sum(map(int, count))} hostname").split()
    assert sorted(set(answered)) == nodes

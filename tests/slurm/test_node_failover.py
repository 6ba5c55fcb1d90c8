"""A retry after a node failure on a cluster that cannot spare all of the failed job's nodes:
a 2-node job on the 3-node local cluster excludes the node that failed, not both.

sinfo lines are Slurm 22.05.8's ``sinfo --noheader --Node --format='%N %t' --nodes=node[1-2]``
on the local cluster (HEALTHY recorded 2026-12-01; a node in two partitions prints twice);
NODE2_DOWN as tests/trainer/test_multinode_faults.py prints it with node2 set DOWN."""

from __future__ import annotations

import pytest

from operators.slurm.commands import sinfo_node_states
from operators.slurm.nodes import retry_exclusions, unhealthy_nodes

pytestmark = pytest.mark.pure

HEALTHY = "node1 idle\nnode1 idle\nnode2 mix\nnode2 mix\n"
NODE2_DOWN = "node1 idle\nnode1 idle\nnode2 down\nnode2 down\n"


@pytest.mark.parametrize(("sinfo", "unhealthy"), [
    (HEALTHY, set()),
    (NODE2_DOWN, {"node2"}),
    ("node1 mix*\nnode2 drng\nnode3 idle~\n", {"node1", "node2"}),  # * = not responding
    ("Welcome to the cluster\nnode3 drain\n", {"node3"}),  # a banner line is not a node
])
def test_unhealthy_nodes(sinfo, unhealthy):
    assert unhealthy_nodes(sinfo) == unhealthy


def test_a_two_node_retry_on_three_nodes_excludes_only_the_failed_one():
    assert retry_exclusions("node[1-2]", 3, 2, unhealthy_nodes(NODE2_DOWN)) == "node2"
    assert retry_exclusions("node[1-2]", 3, 2, unhealthy_nodes(HEALTHY)) is None
    assert retry_exclusions("node[1-2]", 3, 2) is None  # unchanged without node states
    assert retry_exclusions("node[1-2]", 2, 2, {"node2"}) is None  # it would never start
    assert retry_exclusions("node[1-2]", 8, 2, {"node2"}) == "node1,node2"  # can spare both


def test_the_node_states_command_is_data():
    assert sinfo_node_states("node[1-2]") == (
        "sinfo --noheader --Node '--format=%N %t' '--nodes=node[1-2]'")

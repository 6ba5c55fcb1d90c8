"""Node lists and the nodes a retry excludes after NODE_FAIL/PREEMPTED: table-driven."""

from __future__ import annotations

import pytest

from operators.slurm.nodes import expand_nodelist, retry_exclusions
from operators.slurm.render import render_script
from operators.slurm.spec import JobSpec


@pytest.mark.parametrize(("nodelist", "nodes"), [
    ("vm", ["vm"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[01-02,07],login1", ["gpu01", "gpu02", "gpu07", "login1"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("nid[001-002],nid010", ["nid001", "nid002", "nid010"]),
])
def test_expand(nodelist, nodes) -> None:
    assert expand_nodelist(nodelist) == nodes


@pytest.mark.parametrize(("failed", "cluster", "needed", "excluded"), [
    ("gpu[01-02]", 8, 2, "gpu01,gpu02"),  # a big cluster spares the failed nodes
    ("gpu[01-02]", 3, 2, None),  # only 1 left for a 2-node job: excluding would hang it
    ("vm", 1, 1, None),  # the single-node local cluster
    ("", 8, 1, None),  # no node recorded
])
def test_retry_exclusions(failed, cluster, needed, excluded) -> None:
    assert retry_exclusions(failed, cluster, needed) == excluded


def test_excluded_nodes_are_rendered_for_the_retry() -> None:
    spec = JobSpec(name="pp-seg-0123456789abcdef", command="true", output="/r/slurm-%j.out",
                   nodes=2, exclude=retry_exclusions("gpu[01-02]", 8, 2))
    assert "#SBATCH --exclude=gpu01,gpu02\n" in render_script(spec)

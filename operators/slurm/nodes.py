"""Node lists: expanding Slurm's compressed form, and which nodes a retry must avoid. Pure."""

from __future__ import annotations

import re

_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?")


def expand_nodelist(nodelist: str) -> list[str]:
    """``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "login1"]``."""
    nodes: list[str] = []
    position = 0
    while position < len(nodelist):
        match = _GROUP.match(nodelist, position)
        if not match:
            raise ValueError(f"cannot read node list {nodelist!r} at {position}")
        prefix, ranges = match.groups()
        if ranges is None:
            nodes.append(prefix)
        else:
            for part in ranges.split(","):
                low, _, high = part.partition("-")
                width = len(low)
                for n in range(int(low), int(high or low) + 1):
                    nodes.append(f"{prefix}{n:0{width}d}")
        position = match.end() + 1  # skip the comma
    return nodes


def retry_exclusions(failed_nodelist: str, cluster_nodes: int, nodes_needed: int) -> str | None:
    """Nodes a retry after a node failure should avoid, when the cluster can spare them.

    On a cluster too small to run the job without them (the single-node local cluster),
    excluding would leave the retry pending forever, so nothing is excluded.
    """
    failed = [n for n in expand_nodelist(failed_nodelist) if n] if failed_nodelist else []
    if not failed or cluster_nodes - len(failed) < nodes_needed:
        return None
    return ",".join(failed)

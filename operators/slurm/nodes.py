"""Node lists: expanding Slurm's compressed form, and which nodes a retry must avoid. Pure."""

from __future__ import annotations

import re

_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_RANGES = r"[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*"
_GROUP = re.compile(rf"^([A-Za-z0-9][A-Za-z0-9_.-]*)(?:\[({_RANGES})\])?$")
# What sacct prints in NodeList for a job that never got nodes (sacct(1), NodeList).
NO_NODES = ("", "None assigned", "(null)")


def _groups(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in nodelist:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def expand_nodelist(nodelist: str) -> list[str]:
    """``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "login1"]``.

    Raises ``ValueError`` naming the list for anything else: a malformed range must never
    reach ``--exclude`` as a made-up node name.
    """
    nodes: list[str] = []
    for group in _groups(nodelist):
        match = _GROUP.match(group)
        if not match:
            raise ValueError(f"cannot read node list {nodelist!r} at {group!r}")
        prefix, ranges = match.groups()
        if ranges is None:
            nodes.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if int(high or low) < int(low):
                raise ValueError(f"cannot read node list {nodelist!r}: range {part!r}")
            nodes += [f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high or low) + 1)]
    return nodes


def retry_exclusions(failed_nodelist: str, cluster_nodes: int, nodes_needed: int) -> str | None:
    """Nodes a retry after a node failure should avoid, when the cluster can spare them.

    On a cluster too small to run the job without them (the single-node local cluster),
    excluding would leave the retry pending forever, so nothing is excluded; nor when
    Slurm recorded no nodes (``None assigned``) or a list we cannot read.
    """
    if failed_nodelist.strip() in NO_NODES:
        return None
    try:
        failed = expand_nodelist(failed_nodelist.strip())
    except ValueError:
        return None
    if not failed or not all(_NODE.match(n) for n in failed):
        return None
    if cluster_nodes - len(failed) < nodes_needed:
        return None
    return ",".join(failed)

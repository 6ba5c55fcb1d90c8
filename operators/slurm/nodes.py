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


# sinfo's compact states (%t) of a node that must not get the retry: down, drained or
# draining, failed or failing; a trailing "*" (any state) means not responding.
_UNHEALTHY = ("down", "drain", "drng", "drained", "draining", "fail", "failg", "failing")


def unhealthy_nodes(sinfo_output: str) -> set[str]:
    """Nodes ``sinfo --Node --format='%N %t'`` shows down, draining, failed or not
    responding (e.g. ``node2 down*``); lines that are not two words (a banner) are skipped."""
    found = set()
    for line in sinfo_output.splitlines():
        words = line.split()
        if len(words) != 2 or not _NODE.match(words[0]):
            continue
        state = words[1].lower()
        if state.endswith("*") or state.rstrip("~#!%$@^-+") in _UNHEALTHY:
            found.add(words[0])
    return found


def retry_exclusions(failed_nodelist: str, cluster_nodes: int, nodes_needed: int,
                     unhealthy: set[str] | frozenset[str] = frozenset()) -> str | None:
    """Nodes a retry after a node failure should avoid, when the cluster can spare them.

    All of the failed job's nodes when the cluster can run the job without them; otherwise
    only those of them that are ``unhealthy`` now (a 2-node job on 3 nodes, one of which
    went down), when that leaves enough. On a cluster too small to run the job without them,
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
    if cluster_nodes - len(failed) >= nodes_needed:
        return ",".join(failed)
    broken = [n for n in failed if n in unhealthy]
    if broken and cluster_nodes - len(broken) >= nodes_needed:
        return ",".join(broken)
    return None

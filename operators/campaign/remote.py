"""Small reads and writes of a campaign's state files on the cluster, over the Slurm hook."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from operators.campaign.layout import Layout


def read_iteration(hook, layout: Layout) -> int:
    """The tracker's iteration (0 before the first checkpoint). Megatron writes no newline."""
    text = hook.read_bytes(layout.tracker).decode().strip()
    return int(text) if text.isdigit() else 0


def read_text(hook, path: str) -> str | None:
    data = hook.read_bytes(path)
    return data.decode() if data else None


def write_file(hook, path: str, content: str) -> None:
    hook.upload(posixpath.dirname(path), {posixpath.basename(path): content})


def read_history(hook, layout: Layout) -> list[dict[str, Any]]:
    """Finished segments of the campaign, oldest first (``segments.jsonl``)."""
    text = read_text(hook, layout.segments_log) or ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append_history(hook, layout: Layout, entry: dict[str, Any]) -> None:
    # Read-modify-write is enough: max_active_runs=1 and segments run one at a time.
    lines = (read_text(hook, layout.segments_log) or "").splitlines()
    lines.append(json.dumps(entry, sort_keys=True))
    write_file(hook, layout.segments_log, "\n".join(lines) + "\n")

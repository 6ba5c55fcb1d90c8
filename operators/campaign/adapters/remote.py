"""Small reads and writes of a campaign's state files on the cluster, over the Slurm hook."""

from __future__ import annotations

import json
import posixpath
import shlex
from typing import TYPE_CHECKING, Any

from operators.campaign.render.layout import Layout

if TYPE_CHECKING:
    from operators.slurm.hook import SlurmHook


def read_iteration(hook: SlurmHook, layout: Layout) -> int:
    """The tracker's iteration (0 before the first checkpoint). Megatron writes no newline."""
    text = hook.read_bytes(layout.tracker).decode().strip()
    return int(text) if text.isdigit() else 0


def read_text(hook: SlurmHook, path: str) -> str | None:
    data = hook.read_bytes(path)
    return data.decode() if data else None


def write_file(hook: SlurmHook, path: str, content: str) -> None:
    hook.upload(posixpath.dirname(path), {posixpath.basename(path): content})


def read_history(hook: SlurmHook, layout: Layout) -> list[dict[str, Any]]:
    """Finished segments of the campaign, oldest first (``segments.jsonl``)."""
    text = read_text(hook, layout.segments_log) or ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append_history(hook: SlurmHook, layout: Layout, entry: dict[str, Any]) -> None:
    # Read-modify-write is enough: max_active_runs=1 and segments run one at a time.
    lines = (read_text(hook, layout.segments_log) or "").splitlines()
    lines.append(json.dumps(entry, sort_keys=True))
    write_file(hook, layout.segments_log, "\n".join(lines) + "\n")


def missing_files(hook: SlurmHook, paths: list[str]) -> list[str]:
    """Those of ``paths`` that are not a readable, non-empty file for the cluster user.

    One shell loop over SSH for all of them, rather than an SFTP session per file; an
    unreadable file counts as missing, since the job could not read it either.
    """
    if not paths:
        return []
    quoted = " ".join(shlex.quote(p) for p in paths)
    rc, out, err = hook.run(f'for f in {quoted}; do [ -r "$f" ] && [ -s "$f" ] '
                            f'|| printf "%s\\n" "$f"; done')
    if rc != 0:
        raise RuntimeError(f"checking {len(paths)} data files on the cluster failed "
                           f"(exit {rc}): {err.strip()}")
    return [line for line in out.splitlines() if line]

"""Small reads and writes of a campaign's state files on the cluster, over the Slurm hook."""

from __future__ import annotations

import json
import logging
import posixpath
import secrets
import shlex
from typing import TYPE_CHECKING, Any

from operators.campaign.render.layout import Layout

if TYPE_CHECKING:
    from operators.slurm.hook import SlurmHook

log = logging.getLogger(__name__)


def read_iteration(hook: SlurmHook, layout: Layout) -> int:
    """The tracker's iteration (0 before the first checkpoint). Megatron writes no newline."""
    text = hook.read_bytes(layout.tracker).decode().strip()
    return int(text) if text.isdigit() else 0


def read_text(hook: SlurmHook, path: str) -> str | None:
    data = hook.read_bytes(path)
    return data.decode() if data else None


def write_file(hook: SlurmHook, path: str, content: str) -> None:
    hook.upload(posixpath.dirname(path), {posixpath.basename(path): content})


def read_records(hook: SlurmHook, path: str) -> list[dict[str, Any]]:
    """The JSON lines of ``path``, oldest first; none when it is not there."""
    text = read_text(hook, path) or ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append_record(hook: SlurmHook, path: str, entry: dict[str, Any]) -> None:
    # Read-modify-write is enough: max_active_runs=1 and segments run one at a time.
    lines = (read_text(hook, path) or "").splitlines()
    lines.append(json.dumps(entry, sort_keys=True))
    write_file(hook, path, "\n".join(lines) + "\n")


def read_history(hook: SlurmHook, layout: Layout) -> list[dict[str, Any]]:
    """Finished segments of the campaign, oldest first (``segments.jsonl``)."""
    return read_records(hook, layout.segments_log)


def append_history(hook: SlurmHook, layout: Layout, entry: dict[str, Any]) -> None:
    append_record(hook, layout.segments_log, entry)


def missing_files(hook: SlurmHook, paths: list[str]) -> list[str]:
    """Those of ``paths`` that are not a readable, non-empty file for the cluster user.

    One shell loop over SSH for all of them, rather than an SFTP session per file; an
    unreadable file counts as missing, since the job could not read it either.
    """
    if not paths:
        return []
    marker = f"pp-missing-{secrets.token_hex(8)}"
    rc, out, err = hook.run(missing_files_command(paths, marker))
    if rc != 0:
        raise RuntimeError(f"checking {len(paths)} data files on the cluster failed "
                           f"(exit {rc}): {err.strip()}")
    return read_missing_files(out, paths, marker)


def missing_files_command(paths: list[str], marker: str) -> str:
    """The loop that prints ``<marker> <index>`` for each missing path, then ``<marker> end``.

    A login shell prints banners and MOTDs on stdout before the command's own output: only
    lines carrying this call's marker are the answer, and they name paths by index, so a
    path's own characters (a newline) cannot pass for another answer line.
    """
    quoted = " ".join(shlex.quote(p) for p in paths)
    m = shlex.quote(marker)
    return (f'i=0; for f in {quoted}; do [ -r "$f" ] && [ -s "$f" ] '
            f"|| printf '%s %d\\n' {m} \"$i\"; i=$((i+1)); done; printf '%s end\\n' {m}")


def read_missing_files(out: str, paths: list[str], marker: str) -> list[str]:
    """The paths :func:`missing_files_command` named as missing in its output ``out``.

    Raises when the closing ``<marker> end`` line is absent: the loop did not finish, and
    an answer cut short would report files present that were never checked.
    """
    missing, ended, skipped = [], False, []
    for line in out.splitlines():
        head, _, rest = line.strip().partition(" ")
        if head != marker:
            if line.strip():
                skipped.append(line)
            continue
        if rest == "end":
            ended = True
        elif rest.isdigit() and int(rest) < len(paths):
            missing.append(paths[int(rest)])
        else:
            raise RuntimeError(f"checking data files on the cluster: unexpected answer line "
                               f"{line[:200]!r}")
    for line in skipped[:5]:
        log.info("skipped a line of the data-file check's output that is not its answer "
                 "(a login banner?): %r", line[:200])
    if not ended:
        raise RuntimeError(f"checking {len(paths)} data files on the cluster: the answer "
                           f"ended early (no {marker} end line): {out.strip()[-200:]!r}")
    return missing

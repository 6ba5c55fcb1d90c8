"""Saving, finding and pruning checkpoints under the tracker contract (docs/contracts.md; its
names are defined in jobscripts/job_files.py).

Layout under a checkpoint root, as Megatron writes it::

    root/latest_checkpointed_iteration.txt   "50" (no newline)
    root/iter_0000050/...                    one directory per saved iteration
    root/iter_0000050/complete.json          written last: every file and its size

A checkpoint counts only when the tracker names it and its directory is complete. Saves
are atomic: files go into a temp directory in the same parent, are fsynced, the directory is
renamed into place, and only then is the tracker replaced. A job killed at any point leaves
either the previous checkpoint or the new one, never a half-written one that looks valid.
Writers are fenced: a job takes the lease (``.checkpoint-lease.json`` beside the tracker) when
it starts, and every save and pruning first checks the lease is still its own, so an orphaned
process of an older job (a node that was cut off and came back after the job was requeued or
retried elsewhere) cannot write into the campaign's checkpoints.
Directories Megatron/Bridge wrote carry no ``complete.json``; they count when Megatron's own
end-of-save files are there (see ``_megatron_finished``).
No torch here: the trainer passes a callback that writes the files.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobscripts.job_files import (
    CHECKPOINT_LEASE,
    COMPLETE_MARKER,
    ITER_DIR_FORMAT,
    ITER_DIR_RE,
    TRACKER_FILENAME,
)

_TEMP_PREFIX = ".tmp-"


def checkpoint_dir(root: str | os.PathLike[str], iteration: int) -> Path:
    return Path(root) / ITER_DIR_FORMAT.format(iteration)


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the parent directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_tracker(root: str | os.PathLike[str]) -> int | None:
    """The iteration the tracker names, or None when it is missing or not a number.

    Megatron also writes ``release`` for converted checkpoints; that is not a training
    position, so it reads as None here.
    """
    try:
        text = (Path(root) / TRACKER_FILENAME).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _replace_file(root: Path, name: str, text: str) -> None:
    """``root/name`` holds ``text`` whole or keeps what it held: written beside it (a temp
    name ``remove_stale_temp`` knows), fsynced, renamed over it, the directory fsynced."""
    fd, tmp = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{name}.", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, root / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(root)


def write_tracker(root: str | os.PathLike[str], iteration: int) -> None:
    # No newline: Megatron's readers strip, others may not.
    _replace_file(Path(root), TRACKER_FILENAME, str(iteration))


class FencedError(RuntimeError):
    """This process no longer holds the checkpoint lease: a newer job took it."""


@dataclass(frozen=True)
class Lease:
    """The right to write a checkpoint root, held by one process of one job incarnation.

    ``job_id`` and ``restart_count`` (Slurm's ``SLURM_JOB_ID``/``SLURM_RESTART_COUNT``) say
    which job holds it; ``token`` tells two holders of the same job apart (a requeued job
    keeps its id, and a process orphaned on a lost node still has the old environment).
    """

    root: Path
    token: str
    job_id: str | None = None
    restart_count: int = 0

    def check(self) -> None:
        """Raise FencedError unless the lease file still names this holder."""
        try:
            current = json.loads((self.root / CHECKPOINT_LEASE).read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError) as exc:
            raise FencedError(f"{self.root}: checkpoint lease unreadable ({exc!r}); "
                              "not writing") from exc
        if current.get("token") != self.token:
            raise FencedError(
                f"{self.root}: checkpoint lease taken by job {current.get('job_id')} "
                f"(restart {current.get('restart_count')}) on {current.get('host')}; this "
                f"process (job {self.job_id}, restart {self.restart_count}) stops writing")


def take_lease(root: str | os.PathLike[str], job_id: str | None = None,
               restart_count: int = 0) -> Lease:
    """Become the root's only writer; whoever held the lease before is fenced from now on."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lease = Lease(root, secrets.token_hex(8), job_id, restart_count)
    record = {"token": lease.token, "job_id": job_id, "restart_count": restart_count,
              "host": socket.gethostname(), "pid": os.getpid()}
    _replace_file(root, CHECKPOINT_LEASE, json.dumps(record))
    return lease


def _file_sizes(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != COMPLETE_MARKER
    }


def save_checkpoint(
    root: str | os.PathLike[str],
    iteration: int,
    write_files: Callable[[Path], None],
    metadata: dict[str, Any] | None = None,
    lease: Lease | None = None,
) -> Path:
    """Write a checkpoint atomically and point the tracker at it; returns its directory.
    With a ``lease``, FencedError (and nothing renamed into place) once it is lost."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, iteration)
    staging = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{final.name}.", dir=root))
    try:
        write_files(staging)
        sizes = _file_sizes(staging)
        for name in sizes:
            with open(staging / name, "rb") as handle:
                os.fsync(handle.fileno())
        marker = {"iteration": iteration, "files": sizes, "metadata": metadata or {}}
        with open(staging / COMPLETE_MARKER, "w", encoding="utf-8") as handle:
            json.dump(marker, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_dir(staging)
        if lease is not None:
            lease.check()  # the last moment before anything a reader sees changes
        if final.exists():
            # A re-save of the same iteration (a crash after rename, before the tracker
            # moved): the old copy is not what the tracker names, so it may go.
            _remove_checkpoint_dir(final)
        os.replace(staging, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if lease is not None:
        lease.check()  # narrows the race with a new holder to the tracker's own rename
    write_tracker(root, iteration)
    return final


def _megatron_finished(path: Path) -> bool:
    """A checkpoint Megatron/Bridge wrote (no marker of ours): torch.distributed.checkpoint
    writes ``.metadata`` only after every rank's shards are written; the legacy format has
    one ``model_optim_rng.pt`` per rank. Truncated shards go unnoticed there."""
    dcp = path / ".metadata"
    if dcp.is_file() and dcp.stat().st_size > 0:
        return True
    return any(p.stat().st_size > 0 for p in path.glob("mp_rank_*/model_optim_rng.pt"))


def check_complete(path: str | os.PathLike[str]) -> str | None:
    """None when the directory is a complete checkpoint, else why it is not."""
    path = Path(path)
    if not path.is_dir():
        return f"{path.name} does not exist"
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text(encoding="utf-8"))
        files = marker["files"]
    except FileNotFoundError:
        if _megatron_finished(path):
            return None
        return f"{path.name} has no {COMPLETE_MARKER} (save did not finish)"
    except (ValueError, KeyError, TypeError) as exc:
        return f"{path.name}/{COMPLETE_MARKER} is unreadable: {exc}"
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{path.name}/{name} is missing"
        if actual != size:
            return f"{path.name}/{name} has {actual} bytes, expected {size} (truncated?)"
    return None


def list_checkpoints(root: str | os.PathLike[str]) -> list[int]:
    """Iterations that have an ``iter_*`` directory, complete or not, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (ITER_DIR_RE.match(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


@dataclass(frozen=True)
class ResumePoint:
    iteration: int
    path: Path
    fallback_reason: str | None = None  # set when this is not the checkpoint the tracker names


def find_resume_checkpoint(root: str | os.PathLike[str]) -> ResumePoint | None:
    """The checkpoint to resume from, or None to start from scratch.

    The tracker's checkpoint when complete; otherwise the newest complete one before it,
    with a reason that says what was wrong. Directories newer than the tracker are never
    used: their save had not been acknowledged.
    """
    root = Path(root)
    tracked = read_tracker(root)
    candidates = list_checkpoints(root)
    if tracked is None:
        if not candidates:
            return None
        problem = f"{TRACKER_FILENAME} is missing or unreadable"
        limit = max(candidates)
    else:
        problem = check_complete(checkpoint_dir(root, tracked))
        if problem is None:
            return ResumePoint(tracked, checkpoint_dir(root, tracked))
        problem = f"tracker names iteration {tracked} but {problem}"
        limit = tracked
    for iteration in reversed(candidates):
        if iteration <= limit and check_complete(checkpoint_dir(root, iteration)) is None:
            reason = f"{problem}; falling back to iteration {iteration}"
            return ResumePoint(iteration, checkpoint_dir(root, iteration), reason)
    raise RuntimeError(f"no complete checkpoint under {root}: {problem}")


def plan_retention(
    iterations: Iterable[int],
    complete: Iterable[int],
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Which iterations to delete: all but the last ``keep_last`` complete ones, the
    multiples of ``keep_every``, and ``protect`` (the tracker's). Nothing newer than the
    newest kept checkpoint is touched: it may be a save in flight. ``keep_last=None`` keeps all.
    """
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the resume point must survive")
    kept = set(sorted(complete)[-keep_last:]) | set(protect)
    if keep_every:
        kept |= {i for i in iterations if i % keep_every == 0}
    newest_kept = max(kept, default=-1)
    return sorted(i for i in iterations if i not in kept and i < newest_kept)


def _remove_checkpoint_dir(path: Path) -> None:
    # Marker first: an interrupted delete then reads as incomplete, never as valid.
    (path / COMPLETE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(path)


def apply_retention(
    root: str | os.PathLike[str], keep_last: int | None, keep_every: int | None = None,
    lease: Lease | None = None,
) -> list[int]:
    """Delete what ``plan_retention`` says under ``root``; returns the deleted iterations."""
    if lease is not None:
        lease.check()
    root = Path(root)
    iterations = list_checkpoints(root)
    complete = [i for i in iterations if check_complete(checkpoint_dir(root, i)) is None]
    tracked = read_tracker(root)
    protect = [tracked] if tracked is not None else []
    doomed = plan_retention(iterations, complete, keep_last, keep_every, protect)
    for iteration in doomed:
        _remove_checkpoint_dir(checkpoint_dir(root, iteration))
    return doomed


def remove_stale_temp(root: str | os.PathLike[str]) -> list[str]:
    """Remove leftovers of saves killed mid-write. Call only when no save can be running."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith(_TEMP_PREFIX)]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [p.name for p in stale]

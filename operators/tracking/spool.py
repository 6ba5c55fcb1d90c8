"""Ops that could not be sent, kept on disk and replayed in order, each once.

    <spool_dir>/ops.jsonl       one op per line (ops.py), appended only
    <spool_dir>/sent.json       the watermark: byte offset of the first op not yet sent
    <spool_dir>/files/<op id>/  copies of files to upload (the originals may be temp files)
    <spool_dir>/rejected.jsonl  ops MLflow refused for a reason other than being down

Appends take an exclusive ``flock`` and write all their lines with one ``write`` on an
``O_APPEND`` descriptor, then fsync. A writer killed mid-line leaves a line without its newline:
the next append terminates it first, and the reader sets unreadable lines aside, so one torn
write never blocks the ops after it.

The watermark moves after each op is sent (atomically: temp file, fsync, rename), so a crash
re-sends at most the op in flight, and every op is idempotent (ops.py). An op refused for any
reason but an outage would be refused on every replay: it goes to ``rejected.jsonl`` with the
error, and the replay goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from operators.tracking import ops as tracking_ops
from operators.tracking.availability import is_unavailable

log = logging.getLogger(__name__)

OPS = "ops.jsonl"
SENT = "sent.json"
REJECTED = "rejected.jsonl"
FILES = "files"
_LOCK = ".lock"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Spool:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.ops_path = self.dir / OPS
        self.sent_path = self.dir / SENT
        self.rejected_path = self.dir / REJECTED

    @contextlib.contextmanager
    def locked(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / _LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- writing -------------------------------------------------------------------------
    def _keep_file(self, op: dict) -> dict:
        """An artifact op pointing at a copy inside the spool."""
        source = Path(op["path"])
        dest = self.dir / FILES / op["id"] / source.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, dest, dirs_exist_ok=True)
        else:
            shutil.copy2(source, dest)
        return {**op, "path": str(dest)}

    def append(self, ops: list[dict]) -> None:
        ops = [self._keep_file(op) if op["op"] == "artifact" else op for op in ops]
        data = "".join(json.dumps(op, separators=(",", ":")) + "\n" for op in ops).encode()
        with self.locked():
            fd = os.open(self.ops_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # terminate a line torn by a killed writer
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- reading -------------------------------------------------------------------------
    def watermark(self) -> int:
        try:
            offset = int(json.loads(self.sent_path.read_text())["offset"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0
        size = self.ops_path.stat().st_size if self.ops_path.exists() else 0
        # Past the end: the ops file was replaced without its watermark. Replaying is safe
        # (ops are idempotent); skipping would lose ops.
        return offset if offset <= size else 0

    def pending(self) -> Iterator[tuple[int, dict | str]]:
        """(end offset, op) for each op after the watermark, read lazily (a long outage can
        spool a million values); unreadable lines come as raw text."""
        if not self.ops_path.exists():
            return
        with open(self.ops_path, "rb") as f:
            f.seek(self.watermark())
            end = f.tell()
            for line in f:
                end += len(line)
                text = line.decode(errors="replace").strip()
                if not text:
                    continue
                try:
                    yield end, json.loads(text)
                except ValueError:
                    yield end, text

    def backlog(self) -> int:
        return sum(1 for _ in self.pending())

    # -- bookkeeping ---------------------------------------------------------------------
    def mark_sent(self, offset: int, op_id: str | None) -> None:
        _write_atomic(self.sent_path, json.dumps({"offset": offset, "last_id": op_id}))

    def reject(self, op: dict | str, error: BaseException | str) -> None:
        if isinstance(error, BaseException):
            code = getattr(error, "error_code", None)
            error = f"{type(error).__name__}{f' {code}' if code else ''}: {error}"
        with open(self.rejected_path, "a") as f:
            f.write(json.dumps({"op": op, "error": error[:2000]}) + "\n")

    def drop_files(self, op: dict) -> None:
        if op.get("op") == "artifact":
            shutil.rmtree(self.dir / FILES / op["id"], ignore_errors=True)

    def compact(self) -> None:
        """Everything sent: start empty (the watermark first, see ``watermark``)."""
        if self.ops_path.exists() and self.watermark() >= self.ops_path.stat().st_size:
            self.sent_path.unlink(missing_ok=True)
            self.ops_path.unlink()
            shutil.rmtree(self.dir / FILES, ignore_errors=True)


def flush(spool_dir: str | os.PathLike | Spool, client, refs: dict[str, str] | None = None) -> int:
    """Send the spooled ops in order; stop at the first outage (the rest wait for the next
    flush). Returns the number of ops sent."""
    spool = spool_dir if isinstance(spool_dir, Spool) else Spool(spool_dir)
    refs = {} if refs is None else refs
    sent = 0
    with spool.locked():
        for offset, op in spool.pending():
            if isinstance(op, str):
                spool.reject(op, "unreadable line (torn write)")
            else:
                try:
                    tracking_ops.send(client, op, refs)
                    sent += 1
                except Exception as exc:
                    if is_unavailable(exc):
                        log.warning("MLflow unavailable; %d spooled ops wait in %s: %s",
                                    spool.backlog(), spool.dir, exc)
                        return sent
                    log.exception("MLflow refused spooled op %s; set aside in %s",
                                  op.get("id"), spool.rejected_path)
                    spool.reject(op, exc)
                spool.drop_files(op)
            spool.mark_sent(offset, op.get("id") if isinstance(op, dict) else None)
        spool.compact()
    return sent

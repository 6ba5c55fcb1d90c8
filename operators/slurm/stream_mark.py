"""How far a trigger has streamed its job's log, kept beside the job on the cluster.

A deferred task's trigger is re-created from the kwargs it was serialised with when it was
deferred: after its triggerer dies, the triggerer that takes it over would start streaming at
the deferral's offsets and repeat every line the dead one had streamed. So after each round that
forwarded lines the trigger writes its offsets (and its log watch's state, which those lines
fed) into :data:`MARK_NAME` in the job's run directory, over the poller's SFTP channel: the SSH
connection the poll already holds, no connection of its own. A trigger starting on a job reads
it back once and goes on from there.

The mark names the *stream* it belongs to by a token that the trigger is given when it is
created for a deferral and that travels in its kwargs: a trigger rebuilt from those kwargs (the
takeover) has the same token and resumes; the trigger of a later deferral or a retry has a new
one and streams the job's log from its own offsets into its own task log.

The mark is written after the lines were logged: a triggerer killed between the two repeats
that round's lines. "Logged" is not "in the task log file": Airflow's triggerer hands a
trigger's lines to its supervisor process over a socket, and a SIGKILL of the triggerer loses
the lines still on their way (the stack story met it: the mark counted 14 lines, the file had
9). Those lines stay in the job's own log; what is streamed after the takeover has no gap.
"""

from __future__ import annotations

import json
import posixpath
import secrets
from dataclasses import dataclass, field
from typing import Any

# In the job's run directory, one per job (an array's tasks share it): hidden, so that a glob
# for the job's own files (slurm-*.out) does not see it.
MARK_NAME = ".pp-log-stream-{job_id}.json"


def new_token() -> str:
    """A stream's token: unique per deferral, not guessable from the job."""
    return secrets.token_hex(8)


def mark_path(log_path: str, job_id: str) -> str:
    """The mark of ``job_id`` beside its log ``log_path`` (or its array log pattern)."""
    return posixpath.join(posixpath.dirname(log_path), MARK_NAME.format(job_id=job_id))


@dataclass(frozen=True)
class StreamMark:
    token: str
    log_offset: int = 0
    log_offsets: dict[str, int] = field(default_factory=dict)  # array task id -> offset
    watch: dict[str, Any] | None = None  # LogWatch.to_json() at these offsets

    def to_bytes(self) -> bytes:
        return json.dumps({"token": self.token, "log_offset": self.log_offset,
                           "log_offsets": self.log_offsets, "watch": self.watch},
                          sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StreamMark | None:
        """The mark in ``data``; None for no mark (an empty or missing file). A mark that is
        not one (a hand-edited or truncated file) raises ValueError naming what is wrong."""
        if not data.strip():
            return None
        try:
            raw = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ValueError(f"log stream mark is not JSON: {exc}") from exc
        if not isinstance(raw, dict) or not isinstance(raw.get("token"), str):
            raise ValueError("log stream mark has no token")
        offsets = raw.get("log_offsets") or {}
        watch = raw.get("watch")
        if not isinstance(offsets, dict) or not (watch is None or isinstance(watch, dict)):
            raise ValueError("log stream mark: log_offsets or watch is not an object")
        try:
            return cls(raw["token"], int(raw.get("log_offset") or 0),
                       {str(k): int(v) for k, v in offsets.items()}, watch)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"log stream mark: an offset is not an integer: {exc}") from exc

    def resume(self, token: str, log_offset: int,
               log_offsets: dict[str, int]) -> StreamMark | None:
        """Where a trigger of stream ``token``, at ``log_offset``/``log_offsets`` from its
        kwargs, goes on: this mark's offsets where they are ahead (never back: lines would
        come twice), with the watch state of the furthest one; None for another stream's mark."""
        if self.token != token:
            return None
        offsets = {t: max(o, self.log_offsets.get(t, 0)) for t, o in log_offsets.items()}
        offsets.update({t: o for t, o in self.log_offsets.items() if t not in offsets})
        ahead = self.log_offset > log_offset
        return StreamMark(token, self.log_offset if ahead else log_offset, offsets,
                          self.watch if ahead else None)


async def read_mark(poller, path: str) -> StreamMark | None:
    """The mark at ``path`` on the poller's SFTP channel (None when there is none)."""
    return StreamMark.from_bytes(await poller.read_bytes(path, 0, 1 << 20))


async def write_mark(poller, path: str, mark: StreamMark) -> None:
    """Replace the mark at ``path`` atomically (a temporary file, then POSIX rename), on the
    poller's SFTP channel: a reader sees the old mark or the new, never half of one."""
    sftp = await poller.sftp()
    tmp = f"{path}.tmp"
    async with sftp.open(tmp, "wb") as handle:
        await handle.write(mark.to_bytes())
    await sftp.posix_rename(tmp, path)

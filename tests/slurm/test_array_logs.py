"""An array job's log streaming: every task's log, each line prefixed with its task id, by
byte offset per file (no repeat, no gap), across a trigger re-created from its kwargs.

The pure tests read local files through a stand-in for the poller's SFTP read (the trigger
only calls ``read_bytes`` and reads ``snapshot``); the cluster test runs a real 3-task array
and the real trigger and poller on one SSH connection.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import re
import uuid
from pathlib import Path

import pytest

from operators.slurm.jobkey import job_key
from operators.slurm.parse import parse_sacct
from operators.slurm.poller import ClusterPoller, Snapshot
from operators.slurm.trigger import SlurmJobTrigger
from tests.support import cluster

# local 22.05.8 (`sacct --jobs=1` while the 3-task array ran, the shape of
# test_real_outputs.ARRAY_ONE_FAILED): tasks 0 and 1 running, task 2 not started yet.
RUNNING = "\n".join([
    "1_0|6|pp-shape-array|RUNNING|0:0|2026-12-01T09:51:58|2026-12-01T09:51:58|Unknown|5|vm|"
    "billing=1,cpu=1,node=1|None",
    "1_1|7|pp-shape-array|RUNNING|0:0|2026-12-01T09:51:58|2026-12-01T09:51:58|Unknown|5|vm|"
    "billing=1,cpu=1,node=1|None",
    "1_[2]|1|pp-shape-array|PENDING|0:0|2026-12-01T09:51:58|Unknown|Unknown|0|"
    "None assigned||Resources",
])
ENDED = "\n".join(
    f"1_{t}|{6 + t}|pp-shape-array|COMPLETED|0:0|2026-12-01T09:51:58|2026-12-01T09:51:58|"
    f"2026-12-01T09:52:03|5|vm|billing=1,cpu=1,node=1|None" for t in range(3))


class LocalFiles:
    """The two things the trigger's log streaming asks of a :class:`ClusterPoller`."""

    def __init__(self) -> None:
        self.snapshot = Snapshot()
        self.reads: list[str] = []
        self.broken = False  # the SFTP channel failing, as a dropped connection does

    async def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        self.reads.append(path)
        if self.broken:
            raise ConnectionResetError("SFTP channel closed")
        return cluster.read_local_bytes(path, offset, limit)


def _logged(trigger: SlurmJobTrigger) -> SlurmJobTrigger:
    """``trigger`` logging through the standard library (Airflow's default is structlog,
    which pytest's caplog does not see); the messages are the ones the task log gets."""
    trigger._log = logging.getLogger("tests.slurm.array_logs")
    return trigger


def _forwarded(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[slurm ")]


def _trigger(tmp_path: Path, **kwargs) -> SlurmJobTrigger:
    return _logged(SlurmJobTrigger("slurm_local", "1", log_path=str(tmp_path / "slurm-1_0.out"),
                                   log_pattern=str(tmp_path / "slurm-1_%a.out"), **kwargs))


def test_every_tasks_log_streamed_once_across_a_restart(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    poller = LocalFiles()
    logs = {t: tmp_path / f"slurm-1_{t}.out" for t in range(3)}
    logs[0].write_text("task 0 a\ntask 0 b\n")
    logs[1].write_text("task 1 a\ntask 1 par")  # a partial line waits for its end
    poller.snapshot = Snapshot(1, parse_sacct(RUNNING))
    first = _trigger(tmp_path)
    asyncio.run(first._stream_log(poller))
    assert _forwarded(caplog) == ["[slurm 1_0] task 0 a", "[slurm 1_0] task 0 b",
                                  "[slurm 1_1] task 1 a"]
    assert str(logs[2]) not in poller.reads  # pending: no log yet

    # The triggerer restarts: the trigger is re-created from its serialised kwargs.
    _, kwargs = first.serialize()
    again = _logged(SlurmJobTrigger(**kwargs))
    caplog.clear()
    with logs[1].open("a") as f:
        f.write("t\ntask 1 c\n")
    logs[2].write_text("task 2 a\n")
    poller.snapshot = Snapshot(2, parse_sacct(ENDED))
    asyncio.run(again._stream_log(poller))
    assert _forwarded(caplog) == ["[slurm 1_1] task 1 part", "[slurm 1_1] task 1 c",
                                  "[slurm 1_2] task 2 a"]

    # Ended and read to the end: a further round forwards nothing and stops reading them.
    caplog.clear()
    asyncio.run(again._stream_log(poller))
    poller.reads.clear()
    asyncio.run(again._stream_log(poller))
    assert _forwarded(caplog) == [] and poller.reads == []


def test_a_task_that_left_the_queue_is_still_read(tmp_path, caplog) -> None:
    """sacct down, squeue no longer lists a finished task: its last lines still come."""
    caplog.set_level(logging.INFO)
    poller = LocalFiles()
    log0 = tmp_path / "slurm-1_0.out"
    log0.write_text("one\n")
    poller.snapshot = Snapshot(1, parse_sacct(RUNNING))
    trigger = _trigger(tmp_path)
    asyncio.run(trigger._stream_log(poller))
    with log0.open("a") as f:
        f.write("two\n")
    poller.snapshot = Snapshot(2, {})  # a round that knows nothing
    asyncio.run(trigger._stream_log(poller))
    assert _forwarded(caplog) == ["[slurm 1_0] one", "[slurm 1_0] two"]


def test_an_ended_tasks_failed_read_is_tried_again(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    poller = LocalFiles()
    for t in range(3):
        (tmp_path / f"slurm-1_{t}.out").write_text(f"last of {t}\n")
    poller.snapshot = Snapshot(1, parse_sacct(ENDED))
    trigger = _trigger(tmp_path)
    poller.broken = True
    asyncio.run(trigger._stream_log(poller))  # every read fails: nothing counts as drained
    poller.broken = False
    asyncio.run(trigger._stream_log(poller))
    assert _forwarded(caplog) == [f"[slurm 1_{t}] last of {t}" for t in range(3)]


def test_a_plain_job_keeps_its_single_log(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    log = tmp_path / "slurm-5.out"
    log.write_text("hello\n")
    trigger = _logged(SlurmJobTrigger("slurm_local", "5", log_path=str(log)))
    asyncio.run(trigger._stream_log(LocalFiles()))
    assert _forwarded(caplog) == ["[slurm 5] hello"] and trigger.log_offset == 6
    assert trigger.serialize()[1]["log_offset"] == 6



def test_three_task_array_every_tasks_lines_on_one_connection(hook, caplog) -> None:
    from operators.slurm.spec import JobSpec

    caplog.set_level(logging.INFO)
    key = job_key("arraylogs", uuid.uuid4().hex, "t")
    run_dir = hook.run_dir(key)
    spec = JobSpec(name=key, comment=key, workdir=run_dir, time="5", array="0-2",
                   output=posixpath.join(run_dir, "slurm-%A_%a.out"),
                   command='for i in 1 2 3 4 5 6; do echo "task $SLURM_ARRAY_TASK_ID line $i";'
                           " sleep 1; done").validate()
    job_id = hook.submit(spec, run_dir)
    pattern = posixpath.join(run_dir, f"slurm-{job_id}_%a.out")

    async def scenario() -> tuple[dict, int]:
        def make(**kwargs) -> SlurmJobTrigger:
            return _logged(SlurmJobTrigger(
                cluster.CONN_ID, job_id, log_path=pattern.replace("%a", "0"), poll_interval=1.0,
                job_name=key, log_pattern=pattern, **kwargs))
        first = make()
        running = asyncio.ensure_future(anext(first.run()))
        # Stop the first trigger mid-run (a triggerer restart), once it forwarded a line.
        while not any(m.startswith(f"[slurm {job_id}_") for m in _forwarded(caplog)):
            await asyncio.sleep(0.2)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        kwargs = first.serialize()[1]
        event = await anext(_logged(SlurmJobTrigger(**kwargs)).run())
        poller = ClusterPoller.get(cluster.CONN_ID, 1.0)
        opened = poller.stats.connections_opened
        await poller._drop()
        return event.payload, opened

    try:
        payload, opened = asyncio.run(scenario())
    finally:
        hook.cancel(job_id)
    assert payload["status"] == "terminal" and payload["outcome"] == "success", payload
    lines = [m for m in _forwarded(caplog) if re.match(rf"\[slurm {job_id}_\d\] task", m)]
    for task in range(3):
        mine = [m for m in lines if m.startswith(f"[slurm {job_id}_{task}] ")]
        # Old: task 0's lines only. Each line once, in order (no repeat, no gap).
        assert mine == [f"[slurm {job_id}_{task}] task {task} line {i}" for i in range(1, 7)]
    assert opened == 1  # every task's log on the poller's one SSH connection

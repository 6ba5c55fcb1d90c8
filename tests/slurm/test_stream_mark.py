"""A trigger taken over by another triggerer streams each job-log line once
(operators/slurm/stream_mark.py): the offsets beside the job, under the deferral's token.

The pure tests read and write local files through a stand-in for the poller's SFTP channel (the
trigger calls ``read_bytes`` and ``sftp().open/posix_rename``); the cluster test runs a real job,
the real trigger and poller, and rebuilds the trigger from the kwargs of its deferral, as the
triggerer that takes over does. The stack story (tests/stack/test_stack.py) kills a real
triggerer.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from pathlib import Path

import pytest

from operators.slurm.jobkey import job_key
from operators.slurm.poller import ClusterPoller
from operators.slurm.stream_mark import MARK_NAME, StreamMark, mark_path
from operators.slurm.trigger import SlurmJobTrigger
from tests.support import cluster


class LocalSftp:
    """The SFTP calls a mark write makes, on local files."""

    def open(self, path: str, mode: str):
        return _File(Path(path).open(mode))

    async def posix_rename(self, old: str, new: str) -> None:
        Path(old).replace(new)


class _File:
    def __init__(self, handle) -> None:
        self.handle = handle

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.handle.close()

    async def write(self, data: bytes) -> None:
        self.handle.write(data)


class LocalPoller:
    """What a trigger's log stream and its mark ask of a :class:`ClusterPoller`."""

    def __init__(self) -> None:
        self.sftp_fails = False

    async def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        return cluster.read_local_bytes(path, offset, limit)

    async def sftp(self):
        if self.sftp_fails:
            raise ConnectionResetError("SFTP channel closed")
        return LocalSftp()


def _logged(trigger: SlurmJobTrigger) -> SlurmJobTrigger:
    trigger._log = logging.getLogger("tests.slurm.stream_mark")
    return trigger


def _forwarded(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[slurm ")]


def test_mark_round_trip_and_path() -> None:
    mark = StreamMark("ab12", 40, {"0": 3, "2": 9}, {"watchers": []})
    assert StreamMark.from_bytes(mark.to_bytes()) == mark
    assert StreamMark.from_bytes(b"") is None
    assert mark_path("/runs/k/slurm-7.out", "7") == "/runs/k/" + MARK_NAME.format(job_id="7")
    assert mark_path("/runs/k/slurm-7_%a.out", "7") == "/runs/k/.pp-log-stream-7.json"


@pytest.mark.parametrize(("data", "says"), [
    (b"{not json", "not JSON"),
    (b'{"log_offset": 3}', "no token"),
    (b'{"token": "t", "log_offsets": [1]}', "not an object"),
    (b'{"token": "t", "log_offset": "x"}', "not an integer"),
])
def test_a_bad_mark_is_named(data: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        StreamMark.from_bytes(data)


def test_resume_goes_forward_on_its_own_stream_only() -> None:
    mark = StreamMark("tok", 120, {"0": 50, "1": 10}, {"w": 1})
    assert mark.resume("other", 0, {}) is None  # a later deferral's or a retry's stream
    ahead = mark.resume("tok", 100, {"0": 60, "2": 5})
    assert (ahead.log_offset, ahead.log_offsets, ahead.watch) == (
        120, {"0": 60, "1": 10, "2": 5}, {"w": 1})
    behind = mark.resume("tok", 200, {})
    assert (behind.log_offset, behind.watch) == (200, None)  # never back; own watch kept


def test_a_trigger_rebuilt_from_its_deferral_goes_on_where_the_first_stopped(
        tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    log = tmp_path / "slurm-5.out"
    log.write_text("one\ntwo\n")
    poller = LocalPoller()
    first = _logged(SlurmJobTrigger("slurm_local", "5", log_path=str(log)))
    _, deferred = first.serialize()  # what the database holds from the deferral on
    asyncio.run(first._stream_log(poller))
    with log.open("a") as f:
        f.write("three\n")

    again = _logged(SlurmJobTrigger(**deferred))  # the other triggerer takes it over
    asyncio.run(again._resume_stream(poller))
    asyncio.run(again._stream_log(poller))
    assert _forwarded(caplog) == ["[slurm 5] one", "[slurm 5] two", "[slurm 5] three"]

    # A new deferral of the same job (a retry) has a token of its own: its log gets it all.
    caplog.clear()
    retry = _logged(SlurmJobTrigger("slurm_local", "5", log_path=str(log)))
    asyncio.run(retry._resume_stream(poller))
    asyncio.run(retry._stream_log(poller))
    assert _forwarded(caplog) == ["[slurm 5] one", "[slurm 5] two", "[slurm 5] three"]


def test_the_event_waits_for_the_last_lines_to_reach_the_trigger_log(tmp_path,
                                                                     monkeypatch) -> None:
    """Airflow files a trigger's lines in the task's trigger log only until it learns the
    trigger finished (then in the triggerer's own log): the event waits FINAL_LOG_GRACE_S after
    the last streamed line, and not at all when no line came lately."""
    from operators.slurm import trigger as trigger_module

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    log = tmp_path / "slurm-6.out"
    log.write_text("")
    quiet = _logged(SlurmJobTrigger("slurm_local", "6", log_path=str(log)))
    asyncio.run(quiet._stream_log(LocalPoller()))  # nothing to stream
    monkeypatch.setattr(trigger_module.asyncio, "sleep", sleep)
    asyncio.run(quiet._hold_the_event())
    assert slept == []
    log.write_text("the last line\n")
    asyncio.run(quiet._stream_log(LocalPoller()))
    asyncio.run(quiet._hold_the_event())
    assert len(slept) == 1 and 0 < slept[0] <= trigger_module.FINAL_LOG_GRACE_S
    assert slept[0] > trigger_module.FINAL_LOG_GRACE_S / 2  # counted from that line


def test_no_event_goes_out_before_the_deferring_workers_exit_has_reached_the_scheduler(
) -> None:
    """A job over in seconds: its event waits until the trigger has run DEFER_EXIT_GRACE_S
    (the stale-event race, apache/airflow#72716); a job found ended later waits nothing more,
    and the log grace still counts from the last line."""
    from operators.slurm.trigger import DEFER_EXIT_GRACE_S, FINAL_LOG_GRACE_S, event_delay

    assert event_delay(100.0, 97.0, None) == DEFER_EXIT_GRACE_S - 3.0
    assert event_delay(100.0, 100.0 - DEFER_EXIT_GRACE_S - 60, None) == 0.0
    assert event_delay(100.0, 100.0 - DEFER_EXIT_GRACE_S - 60, 99.5) == FINAL_LOG_GRACE_S - 0.5
    assert event_delay(100.0, 99.0, 99.5) == DEFER_EXIT_GRACE_S - 1.0
    assert event_delay(100.0, None, None) == 0.0


def test_an_array_resumes_every_tasks_offset(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    from operators.slurm.poller import Snapshot

    poller = LocalPoller()
    poller.snapshot = Snapshot()
    (tmp_path / "slurm-1_0.out").write_text("a\n")
    kwargs = {"log_path": str(tmp_path / "slurm-1_0.out"),
              "log_pattern": str(tmp_path / "slurm-1_%a.out"), "log_offsets": {"0": 0}}
    first = _logged(SlurmJobTrigger("slurm_local", "1", **kwargs))
    deferred = first.serialize()[1]
    asyncio.run(first._stream_log(poller))
    again = _logged(SlurmJobTrigger(**deferred))
    asyncio.run(again._resume_stream(poller))
    assert again.log_offsets == {"0": 2}
    asyncio.run(again._stream_log(poller))
    assert _forwarded(caplog) == ["[slurm 1_0] a"]


def test_a_mark_not_written_is_said_once_and_streaming_goes_on(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    log = tmp_path / "slurm-6.out"
    log.write_text("x\n")
    poller = LocalPoller()
    poller.sftp_fails = True
    trigger = _logged(SlurmJobTrigger("slurm_local", "6", log_path=str(log)))
    asyncio.run(trigger._stream_log(poller))
    with log.open("a") as f:
        f.write("y\n")
    asyncio.run(trigger._stream_log(poller))
    assert _forwarded(caplog) == ["[slurm 6] x", "[slurm 6] y"]
    said = [r for r in caplog.records if "not written" in r.getMessage()]
    assert len(said) == 1


def test_a_takeover_on_the_cluster_streams_each_line_once(hook, caplog) -> None:
    """A real job and the real poller: the first trigger is stopped (its triggerer died) once
    it streamed a line; one rebuilt from the deferral's kwargs streams the rest, once."""
    from operators.slurm.spec import JobSpec

    caplog.set_level(logging.INFO)
    key = job_key("streammark", uuid.uuid4().hex, "t")
    run_dir = hook.run_dir(key)
    spec = JobSpec(name=key, comment=key, workdir=run_dir, time="5",
                   output=f"{run_dir}/slurm-%j.out",
                   command='for i in 1 2 3 4 5 6; do echo "line $i"; sleep 1; done').validate()
    job_id = hook.submit(spec, run_dir)
    log_path = f"{run_dir}/slurm-{job_id}.out"

    async def scenario() -> dict:
        first = _logged(SlurmJobTrigger(cluster.CONN_ID, job_id, log_path=log_path,
                                        poll_interval=1.0, job_name=key))
        deferred = first.serialize()[1]
        running = asyncio.ensure_future(anext(first.run()))
        while not any(m.startswith(f"[slurm {job_id}] line 2") for m in _forwarded(caplog)):
            await asyncio.sleep(0.2)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        event = await anext(_logged(SlurmJobTrigger(**deferred)).run())
        await ClusterPoller.get(cluster.CONN_ID, 1.0)._drop()
        return event.payload

    try:
        payload = asyncio.run(scenario())
    finally:
        hook.cancel(job_id)
    assert payload["status"] == "terminal" and payload["outcome"] == "success", payload
    lines = [m for m in _forwarded(caplog) if re.match(rf"\[slurm {job_id}\] line", m)]
    assert lines == [f"[slurm {job_id}] line {i}" for i in range(1, 7)]
    assert any("log stream resumed at byte" in r.getMessage() for r in caplog.records)

"""The typed messages between trigger, operator and XCom (operators/slurm/messages.py): what
they put in JSON and what they read back. Pure.

The record is a real one: sacct output captured on the local cluster (tests/slurm/
test_real_outputs.py, "local 22.05.8": an array job whose task 1 exits 7).
"""

from __future__ import annotations

import json

from operators.slurm.messages import ERROR, TERMINAL, JobEvent, JobLocation, JobSummary
from operators.slurm.parse import JobRecord, job_view, parse_sacct
from tests.slurm.test_real_outputs import ARRAY_ONE_FAILED

# The keys the UI, DAG templates and segments.jsonl ("slurm") have read since the first
# version; a message may not drop or rename one.
RECORD_KEYS = ["job_id", "state", "state_detail", "exit_code", "signal", "submit", "start",
               "end", "elapsed_s", "nodelist", "gpus", "reason"]
SUMMARY_KEYS = ["job_id", "outcome", "record", "run_dir", "log_path", "result"]


def _through_json(payload: dict) -> dict:
    """What Airflow stores and hands back: JSON text, parsed again."""
    return json.loads(json.dumps(payload))


def _record() -> JobRecord:
    return job_view(parse_sacct(ARRAY_ONE_FAILED), "1")


def test_a_record_survives_json_but_for_its_key_and_source() -> None:
    record = _record()
    payload = _through_json(record.to_json())
    assert list(payload) == RECORD_KEYS
    assert payload["start"] == "2026-12-01T09:51:58" and payload["exit_code"] == 7
    back = JobRecord.from_json(payload)
    assert back == JobRecord(**{**record.__dict__, "name": ""})
    assert back.queue_wait_s == record.queue_wait_s


def test_an_event_tells_a_result_not_read_from_an_empty_one() -> None:
    record = _record()
    unread = JobEvent.from_json(_through_json(
        JobEvent(TERMINAL, "1", 120, outcome="failed", record=record).to_json()))
    assert not unread.result_read and "result" not in unread.to_json()
    empty = JobEvent.from_json(_through_json(
        JobEvent(TERMINAL, "1", outcome="failed", record=record, result=None).to_json()))
    assert empty.result_read and empty.result is None
    assert (unread.log_offset, unread.record.state, unread.record.exit_code) == (120, "FAILED", 7)


def test_an_error_event_carries_its_message() -> None:
    event = JobEvent.from_json(_through_json(
        JobEvent(ERROR, "9", message="state unknown for 601s").to_json()))
    assert (event.status, event.message, event.record) == (ERROR, "state unknown for 601s", None)


def test_the_summary_and_the_location_keep_their_xcom_keys() -> None:
    summary = JobSummary("1", "success", _record(), "/runs/k", "/runs/k/slurm-1.out",
                         {"end_iteration": 250})
    payload = _through_json(summary.to_json())
    assert list(payload) == SUMMARY_KEYS and list(payload["record"]) == RECORD_KEYS
    assert JobSummary.from_json(payload).result == {"end_iteration": 250}
    assert JobSummary.from_json(payload).record.start == _record().start
    where = JobLocation("1", "/runs/k/slurm-1.out", "/runs/k")
    assert where.to_json() == {"job_id": "1", "log_path": "/runs/k/slurm-1.out",
                               "run_dir": "/runs/k"}
    assert JobLocation.from_json(where.to_json()) == where

"""Parsing of sbatch/sacct/squeue output and the meaning of states: table-driven."""

from __future__ import annotations

from datetime import datetime

import pytest

from operators.slurm.jobkey import job_key
from operators.slurm.parse import (
    SACCT_FIELDS,
    SlurmParseError,
    parse_sacct,
    parse_sbatch,
    parse_squeue,
)
from operators.slurm.states import Outcome, UnknownSlurmState, classify


@pytest.mark.parametrize(("out", "job_id"), [
    ("123\n", "123"), ("123;pp-local\n", "123"), ("Submitted batch job 9\n7\n", "7"),
    ("45_3", "45_3"),
    ("5610208;mpp2\n", "5610208"),  # sbatch.c (SchedMD/slurm): --parsable, "%u;%s"
    ("sbatch: warning: --mem ignored\n778\n", "778"),  # issue 13: a warning before the id
    ("=== Welcome to pp-local ===\n13\n", "13"),  # a login banner before the id
])
def test_parse_sbatch(out: str, job_id: str) -> None:
    assert parse_sbatch(out) == job_id


@pytest.mark.parametrize("out", ["", "sbatch: error: Batch job submission failed\n", "abc"])
def test_parse_sbatch_rejects_garbage(out: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_sbatch(out)


def row(job_id, state, exit_code="0:0", name="pp-x", nodes="node1", tres="cpu=1,mem=1G,node=1",
        start="2026-11-29T10:00:05", end="2026-11-29T10:01:05", elapsed="60", reason="None"):
    cells = dict(JobID=job_id, JobIDRaw=job_id.split("_")[0], JobName=name, State=state,
                 ExitCode=exit_code, Submit="2026-11-29T10:00:00", Start=start, End=end,
                 ElapsedRaw=elapsed, NodeList=nodes, AllocTRES=tres, Reason=reason)
    assert list(cells) == list(SACCT_FIELDS)
    return "|".join(cells.values())


def test_sacct_skips_steps_but_takes_batch_exit_code() -> None:
    out = "\n".join([
        row("100", "FAILED", "0:0"),
        row("100.batch", "FAILED", "3:0", name="batch"),
        row("100.extern", "COMPLETED", name="extern"),
        row("100.0", "FAILED", "1:0", name="python"),
    ])
    records = parse_sacct(out)
    assert list(records) == ["100"]
    assert (records["100"].state, records["100"].exit_code) == ("FAILED", 3)
    assert records["100"].queue_wait_s == 5.0
    assert records["100"].start == datetime(2026, 11, 29, 10, 0, 5)


@pytest.mark.parametrize(("state", "base", "detail", "outcome"), [
    ("COMPLETED", "COMPLETED", "", Outcome.SUCCESS),
    ("CANCELLED by 1000", "CANCELLED", "by 1000", Outcome.FAILURE),
    ("CANCELLED+", "CANCELLED", "", Outcome.FAILURE),
    ("TIMEOUT", "TIMEOUT", "", Outcome.TIME_LIMIT),
    ("NODE_FAIL", "NODE_FAIL", "", Outcome.RETRYABLE),
    ("PREEMPTED", "PREEMPTED", "", Outcome.RETRYABLE),
    ("BOOT_FAIL", "BOOT_FAIL", "", Outcome.RETRYABLE),
    ("OUT_OF_MEMORY", "OUT_OF_MEMORY", "", Outcome.FAILURE),
    ("DEADLINE", "DEADLINE", "", Outcome.FAILURE),
    ("FAILED", "FAILED", "", Outcome.FAILURE),
    ("PENDING", "PENDING", "", Outcome.ACTIVE),
    ("RUNNING", "RUNNING", "", Outcome.ACTIVE),
    ("REQUEUED", "REQUEUED", "", Outcome.ACTIVE),
    ("COMPLETING", "COMPLETING", "", Outcome.ACTIVE),
    ("SUSPENDED", "SUSPENDED", "", Outcome.ACTIVE),
    ("RESIZING", "RESIZING", "", Outcome.ACTIVE),
    ("CONFIGURING", "CONFIGURING", "", Outcome.ACTIVE),
])
def test_states(state: str, base: str, detail: str, outcome: Outcome) -> None:
    record = parse_sacct(row("7", state))["7"]
    assert (record.state, record.state_detail) == (base, detail)
    assert classify(state) is outcome


def test_unknown_state_raises_instead_of_polling_forever() -> None:
    with pytest.raises(UnknownSlurmState):
        classify("WIBBLE")
    assert not Outcome.UNKNOWN.terminal and not Outcome.ACTIVE.terminal
    assert Outcome.FAILURE.terminal and Outcome.TIME_LIMIT.terminal


def test_sacct_array_tasks_and_gpus() -> None:
    out = "\n".join([
        row("200_0", "COMPLETED", tres="billing=4,cpu=4,gres/gpu=4,node=1"),
        row("200_1", "FAILED", "1:0", tres="gres/gpu:h100=2,cpu=2"),
        row("200_[2-5]", "PENDING", start="Unknown", end="Unknown", elapsed="0"),
    ])
    records = parse_sacct(out)
    assert records["200_0"].gpus == 4 and records["200_1"].gpus == 2
    assert records["200_1"].exit_code == 1
    assert records["200_[2-5]"].start is None and records["200_[2-5]"].state == "PENDING"


def test_sacct_signal_and_reason() -> None:
    record = parse_sacct(row("8", "CANCELLED by 0", "0:15", reason="Dependency"))["8"]
    assert (record.signal, record.reason) == (15, "Dependency")
    assert parse_sacct(row("9", "COMPLETED"))["9"].reason == ""


def test_sacct_line_of_the_wrong_shape_is_skipped_and_reported() -> None:
    from operators.slurm.parse import read_sacct

    rows = read_sacct("1|2|3\n" + row("9", "COMPLETED"))
    assert list(rows.records) == ["9"] and rows.skipped == ("1|2|3",)


def test_squeue() -> None:
    records = parse_squeue("300|pp-a|PENDING|Priority|\n301|pp-b|R|None|node1\n")
    assert records["300"].reason == "Priority"
    assert records["301"].state == "RUNNING" and records["301"].nodelist == "node1"
    assert parse_squeue("300|pp-a\n") == {}  # not a row: skipped


def test_job_key_is_deterministic_and_ignores_try_number() -> None:
    a = job_key("dag", "manual__2026", "train.segment_1", -1, 1)
    assert a == job_key("dag", "manual__2026", "train.segment_1", -1, 1)
    assert a != job_key("dag", "manual__2026", "train.segment_1", -1, 2)
    assert a != job_key("dag", "manual__2027", "train.segment_1", -1, 1)
    assert a != job_key("dag", "manual__2026", "train.segment_1", 0, 1)
    assert a.startswith("pp-train.segment_1-") and len(a.rsplit("-", 1)[1]) == 16
    weird = job_key("d", "r", "$(rm -rf /)\n;x", 0)
    assert weird.replace("-", "").replace("_", "").replace(".", "").isalnum()


def test_settle_gate_waits_for_sacct_after_a_squeue_only_end() -> None:
    from operators.slurm.states import SettleGate

    gate = SettleGate(grace_s=30)
    assert not gate.final(Outcome.ACTIVE, "sacct", 0)
    assert gate.final(Outcome.SUCCESS, "sacct", 1)  # sacct's word is final at once
    assert not gate.final(Outcome.SUCCESS, "squeue", 2)  # squeue's is provisional...
    assert not gate.final(Outcome.SUCCESS, "squeue", 31)
    assert gate.final(Outcome.SUCCESS, "squeue", 32)  # ...until the grace runs out
    assert not gate.final(Outcome.ACTIVE, "squeue", 33)  # a requeue resets it
    assert not gate.final(Outcome.FAILURE, "squeue", 34)


def test_settle_gate_holds_a_retryable_end_for_a_requeue() -> None:
    from operators.slurm.states import SettleGate

    gate = SettleGate(grace_s=30, requeue_grace_s=10)
    assert not gate.final(Outcome.RETRYABLE, "sacct", 0)  # NODE_FAIL: Slurm may requeue
    assert not gate.final(Outcome.ACTIVE, "squeue", 5)  # it did: the wait starts over
    assert not gate.final(Outcome.RETRYABLE, "sacct", 100)
    assert gate.final(Outcome.RETRYABLE, "sacct", 110)  # no requeue came: final
    assert SettleGate(requeue_grace_s=10).final(Outcome.FAILURE, "sacct", 0)  # no wait


@pytest.mark.parametrize(("sacct_state", "squeue_state", "seen", "detail"), [
    ("NODE_FAIL", "PENDING", "PENDING", "requeued after NODE_FAIL"),  # Slurm requeued it
    ("PREEMPTED", "RUNNING", "RUNNING", "requeued after PREEMPTED"),
    ("NODE_FAIL", "NODE_FAIL", "NODE_FAIL", ""),  # --no-requeue: the end stands
    ("FAILED", "PENDING", "FAILED", ""),  # only retryable ends are second-guessed
    ("COMPLETED", "RUNNING", "COMPLETED", ""),
    (None, "PENDING", "PENDING", ""),  # sacct does not know it yet
])
def test_merge_live_prefers_squeue_for_unknown_and_requeued_jobs(
        sacct_state, squeue_state, seen, detail) -> None:
    from operators.slurm.parse import merge_live, needs_squeue

    records = parse_sacct(row("7", sacct_state)) if sacct_state else {}
    live = parse_squeue(f"7|pp-x|{squeue_state}|None|node1\n")
    assert needs_squeue(records, "7") == (sacct_state in (None, "NODE_FAIL", "PREEMPTED"))
    merged = merge_live(records, live)["7"]
    assert (merged.state, merged.state_detail) == (seen, detail)
    assert merged.source == ("sacct" if seen == sacct_state else "squeue")


def test_merge_live_keeps_jobs_squeue_does_not_list() -> None:
    from operators.slurm.parse import merge_live

    records = parse_sacct(row("7", "NODE_FAIL"))
    assert merge_live(records, {}) == records

"""What real clusters print, parsed: job arrays, het jobs, banners, accounting outages,
wrapped sbatch. Pure.

Every row of output below names its source:
- "local 22.05.8": captured on this project's local cluster (Debian slurm-wlm 22.05.8,
  docker/local_cluster.sh) on 2026-12-01, with the commands of operators/slurm/commands.py;
- "sacct(1)", "squeue(1)", "sbatch.c", "heterogeneous_jobs": Slurm's man pages, source
  (src/sbatch/sbatch.c) and doc/html/heterogeneous_jobs.shtml at SchedMD/slurm 284c3b95;
- "issue 13": outputs of wrapped sbatch quoted by issue 13 from other sites' records.
"""

from __future__ import annotations

import pytest

from operators.slurm import commands, query
from operators.slurm.errors import SlurmCommandError, program
from operators.slurm.nodes import expand_nodelist, retry_exclusions
from operators.slurm.parse import (
    SlurmParseError,
    job_view,
    newest_job,
    parse_sacct,
    parse_sbatch,
    read_sacct,
    read_squeue,
)
from operators.slurm.states import Outcome, classify

# -- sbatch -------------------------------------------------------------------------------

# (Shapes the old parser already read -- "12", "5610208;mpp2", a warning or a banner line
# before the id -- are rows of test_parse.py's test_parse_sbatch.)
@pytest.mark.parametrize(("out", "job_id"), [
    ("Submitted batch job 5610208\n", "5610208"),  # sbatch.c without --parsable; issue 13
    ("Submitted batch job 4\n", "4"),  # local 22.05.8: plain sbatch
    ("sbatch: Submitted batch job 654321\n", "654321"),  # issue 13: a wrapper's prefix
    ("Submitted batch job 630114 on cluster mpp2\n", "630114"),  # sbatch.c " on cluster %s"
    ("sbatch: warning: --mem ignored\nSubmitted batch job 778\n", "778"),  # issue 13
])
def test_sbatch_as_sites_print_it(out: str, job_id: str) -> None:
    assert parse_sbatch(out) == job_id


@pytest.mark.parametrize("out", [
    "", "sbatch: error: Batch job submission failed: Invalid account\n",  # sbatch.c, error()
    "=== Welcome to pp-local ===\n",  # a wrapper that swallowed the id
])
def test_sbatch_without_an_id(out: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_sbatch(out)


# -- job arrays ---------------------------------------------------------------------------

F = "|".join  # sacct --parsable2 joins cells with '|'

# local 22.05.8: `sbatch --array=0-2` whose task 1 exits 7 (sacct --jobs=1).
ARRAY_ONE_FAILED = "\n".join([
    "1_0|6|pp-shape-array|COMPLETED|0:0|2026-12-01T09:51:58|2026-12-01T09:51:58|"
    "2026-12-01T09:52:03|5|vm|billing=1,cpu=1,node=1|None",
    "1_0.batch|6.batch|batch|COMPLETED|0:0|2026-12-01T09:51:58|2026-12-01T09:51:58|"
    "2026-12-01T09:52:03|5|vm|cpu=1,mem=0,node=1|",
    "1_1|7|pp-shape-array|FAILED|7:0|2026-12-01T09:51:58|2026-12-01T09:51:58|"
    "2026-12-01T09:52:03|5|vm|billing=1,cpu=1,node=1|None",
    "1_1.batch|7.batch|batch|FAILED|7:0|2026-12-01T09:51:58|2026-12-01T09:51:58|"
    "2026-12-01T09:52:03|5|vm|cpu=1,mem=0,node=1|",
    "1_2|1|pp-shape-array|COMPLETED|0:0|2026-12-01T09:51:58|2026-12-01T09:51:58|"
    "2026-12-01T09:52:03|5|vm|billing=1,cpu=1,node=1|None",
])
# local 22.05.8: `sbatch --hold --array=2-4%25` (sacct --jobs=13), every task pending.
ARRAY_PENDING = ("13_[2-4%25]|13|pp-shape-pend|PENDING|0:0|2026-12-01T09:53:53|Unknown|"
                 "Unknown|0|None assigned||JobHeldUser")


def test_an_array_with_one_failed_task_failed_naming_it() -> None:
    records = parse_sacct(ARRAY_ONE_FAILED)
    view = job_view(records, "1")
    assert classify(view.state) is Outcome.FAILURE  # not the success of its highest task
    assert view.exit_code == 7
    assert "1_1 FAILED exit code 7" in view.state_detail and "1_0" not in view.state_detail
    assert view.job_id == "1" and view.source == "sacct"


def test_key_lookup_of_an_array_sees_the_whole_array() -> None:
    # Old: the newest row by id (task 1_2, COMPLETED) was re-attached as a success.
    found = newest_job(parse_sacct(ARRAY_ONE_FAILED), "pp-shape-array")
    assert found.job_id == "1" and found.state == "FAILED"
    # Success only when every task succeeded.
    done = newest_job(parse_sacct(ARRAY_ONE_FAILED.replace("FAILED|7:0", "COMPLETED|0:0")),
                      "pp-shape-array")
    assert (done.job_id, done.state, done.exit_code, done.state_detail) == (
        "1", "COMPLETED", 0, "")
    # Active while any task is, however its highest task ended.
    running = newest_job(parse_sacct(ARRAY_ONE_FAILED.replace(
        "1_0|6|pp-shape-array|COMPLETED", "1_0|6|pp-shape-array|RUNNING")), "pp-shape-array")
    assert (running.job_id, running.state, running.end) == ("1", "RUNNING", None)


def test_a_pending_array_is_one_job_and_its_tasks_are_found_by_their_ids() -> None:
    records = parse_sacct(ARRAY_PENDING)
    assert list(records) == ["13_[2-4%25]"]
    assert job_view(records, "13").state == "PENDING"
    assert newest_job(records, "pp-shape-pend").job_id == "13"  # old: "13_[2-4%25]"
    assert job_view(records, "13_3").job_id == "13_3"  # inside the range row (old: None)
    assert job_view(records, "13_3").state == "PENDING"
    assert job_view(records, "13_5") is None and job_view(records, "13_[2-4%25]") is not None
    # local 22.05.8: `squeue --array` prints pending tasks one a line; without --array, one
    # row `13_[2-4%25]|pp-shape-pend|PENDING|JobHeldUser|` (squeue(1), -r).
    live = read_squeue("13_3|pp-shape-pend|PENDING|JobHeldUser|\n").records
    assert job_view(live, "13_3").state == "PENDING"
    assert "--array" in commands.squeue_jobs(["13_3"]).split()


# -- heterogeneous jobs --------------------------------------------------------------------

# local 22.05.8: a two-component job (`#SBATCH hetjob`), pending then cancelled.
HET_PENDING_SQUEUE = ("10+0|pp-shape-het2|PENDING|Resources|\n"
                      "10+1|pp-shape-het2|PENDING|Resources|\n")
HET_CANCELLED_SACCT = "\n".join([
    "10+0|10|pp-shape-het2|CANCELLED by 0|0:0|2026-12-01T09:53:30|None|2026-12-01T09:53:56|0|"
    "None assigned||None",
    "10+1|11|pp-shape-het2|CANCELLED by 0|0:0|2026-12-01T09:53:30|None|2026-12-01T09:53:56|0|"
    "None assigned||None",
])
# heterogeneous_jobs: `squeue --job=93` of a running three-component job.
HET_RUNNING = "93+0|pp-h|RUNNING|None|nid00001\n93+1|pp-h|RUNNING|None|nid00011\n" \
              "93+2|pp-h|RUNNING|None|nid00021\n"


def test_a_het_job_is_found_by_its_leader_id() -> None:
    assert job_view(read_squeue(HET_PENDING_SQUEUE).records, "10").state == "PENDING"
    running = job_view(read_squeue(HET_RUNNING).records, "93")
    assert running.state == "RUNNING" and running.nodelist == "nid00001,nid00011,nid00021"
    cancelled = job_view(parse_sacct(HET_CANCELLED_SACCT), "10")
    assert (cancelled.state, cancelled.state_detail.startswith("not completed: 10+0")) == (
        "CANCELLED", True)
    assert job_view(read_squeue(HET_RUNNING).records, "93+1").nodelist == "nid00011"


def test_a_het_job_completes_when_every_component_did() -> None:
    rows = HET_CANCELLED_SACCT.replace("CANCELLED by 0", "COMPLETED")
    assert job_view(parse_sacct(rows), "10").state == "COMPLETED"
    one_failed = HET_CANCELLED_SACCT.replace("10+0|10|pp-shape-het2|CANCELLED by 0|0:0",
                                             "10+0|10|pp-shape-het2|COMPLETED|0:0")
    one_failed = one_failed.replace("CANCELLED by 0|0:0", "FAILED|1:0")
    view = job_view(parse_sacct(one_failed), "10")
    assert (view.state, view.exit_code) == ("FAILED", 1) and "10+1 FAILED" in view.state_detail


# -- lines that are not jobs -----------------------------------------------------------------

BANNER = ("=== Welcome to pp-local: maintenance Tue 2026-12-08 08:00-12:00 ===\n"
          "Your project quota is 93% full | run `quota -s`\n")


def test_banner_lines_are_skipped_and_reported_not_fatal() -> None:
    live = read_squeue(BANNER + HET_RUNNING)
    assert sorted(live.records) == ["93+0", "93+1", "93+2"]
    assert len(live.skipped) == 2
    done = read_sacct(BANNER + ARRAY_ONE_FAILED)
    assert job_view(done.records, "1").state == "FAILED" and len(done.skipped) == 2


def test_sinfo_node_count_ignores_banner_words() -> None:
    assert commands.sinfo_node_count("Welcome to cluster 2 of 3\n1\n") == 1  # old: 6


# -- accounting down -----------------------------------------------------------------------

# local 22.05.8: sacct with slurmdbd stopped (rc 1, nothing on stdout).
SACCT_DOWN = query.Result(1, "", (
    "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection "
    "to host:127.0.0.1:6819: Connection refused\n"
    "sacct: error: Sending PersistInit msg: Connection refused\n"
    "sacct: error: Problem talking to the database: Connection refused\n"))
# local 22.05.8: squeue --jobs=<an id it no longer holds>.
SQUEUE_UNKNOWN = query.Result(1, "", "slurm_load_jobs error: Invalid job id specified\n")


def drive(job_ids: list[str], *results: query.Result) -> tuple[query.Status, list[str]]:
    sent, answers = [], iter(results)

    def run(line: str) -> query.Result:
        sent.append(line)
        return next(answers)
    return query.run_blocking(query.status(job_ids), run), sent


def test_sacct_down_follows_live_jobs_through_squeue() -> None:
    squeue = query.Result(0, "15|pp-shape-sleep|RUNNING|None|vm\n", "")
    found, sent = drive(["15", "16"], SACCT_DOWN, squeue)
    assert [program(s) for s in sent] == ["sacct", "squeue"]
    assert "--jobs=15,16" in sent[1]  # every job, not only those sacct did not know
    assert job_view(found.records, "15").state == "RUNNING"  # old: the round failed
    assert job_view(found.records, "16") is None  # neither knows it: unknown, not failed
    assert "Problem talking to the database" in found.degraded


def test_sacct_down_and_squeue_knows_none_is_unknown_not_an_error() -> None:
    found, _ = drive(["15"], SACCT_DOWN, SQUEUE_UNKNOWN)
    assert found.records == {} and found.degraded


def test_a_round_fails_only_when_nothing_answered() -> None:
    refused = query.Result(1, "", "squeue: error: Unable to contact slurm controller\n")
    with pytest.raises(SlurmCommandError, match="Unable to contact"):
        drive(["15"], SACCT_DOWN, refused)
    # sacct failed but printed rows (a partial answer): they count.
    partial = query.Result(1, ARRAY_ONE_FAILED, "sacct: error: something\n")
    found, sent = drive(["1"], partial, SQUEUE_UNKNOWN)
    assert not found.degraded and job_view(found.records, "1").state == "FAILED"


# -- small ones ----------------------------------------------------------------------------

def test_rd_is_resv_del_hold() -> None:  # squeue(1), JOB STATE CODES
    assert read_squeue("5|pp-x|RD|Reservation|\n").records["5"].state == "RESV_DEL_HOLD"
    assert classify("RD") is Outcome.ACTIVE


@pytest.mark.parametrize("line", [commands.sacct_jobs(["1"]), commands.squeue_jobs(["1"]),
                                  commands.sacct_name("pp-x"), commands.squeue_name("pp-x")])
def test_every_query_sets_standard_times(line: str) -> None:
    # sacct(1)/squeue(1) ENVIRONMENT: under a site's SLURM_TIME_FORMAT=relative, sacct prints
    # "1_2|1|pp-shape-array|COMPLETED|0:0|09:51:58|09:51:58|09:52:03|..." (local 22.05.8),
    # times that read as None. SLURM_BITSTR_LEN=0: array task expressions printed whole.
    assert line.startswith("SLURM_TIME_FORMAT=standard SLURM_BITSTR_LEN=0 ")


@pytest.mark.parametrize("nodelist", [
    "None assigned",  # local 22.05.8: NodeList of a job that never started
    "gpu[01-", "gpu[01-02]]x", "a,,b", "(null)",
])
def test_unreadable_node_lists_never_reach_exclude(nodelist: str) -> None:
    assert retry_exclusions(nodelist, 8, 1) is None


def test_malformed_range_is_an_error_not_a_node_name() -> None:
    with pytest.raises(ValueError, match="gpu\\[01-"):
        expand_nodelist("gpu[01-")


def test_a_reused_job_id_is_not_ours() -> None:
    # Issue 13 asks for this test of an existing guard (the key check): it fails only when
    # the check is removed. sacct(1) --duplicates: after a controller reset job ids start
    # again (they did on the local cluster on 2026-12-01), and --jobs returns the newest job
    # of that id. Our key names the job: another name is someone else's.
    theirs = ARRAY_ONE_FAILED.replace("pp-shape-array", "someone-elses")
    assert newest_job(parse_sacct(theirs), "pp-shape-array") is None
    assert newest_job(parse_sacct(ARRAY_ONE_FAILED + "\n" + theirs.splitlines()[0].replace(
        "1_0|6|", "2|8|")), "pp-shape-array").job_id == "1"


def test_an_array_sacct_reads_as_ended_is_checked_against_squeue() -> None:
    # local 22.05.8: polled as its tasks ended, sacct read array 33 as COMPLETED, exit 0:
    # completed rows of other tasks and no row yet for task 1, which failed (sacct a moment
    # later: 33_1|35|...|FAILED|7:0). squeue --array lists every task for MinJobAge.
    from operators.slurm.parse import merge_live, needs_squeue

    early = parse_sacct(ARRAY_ONE_FAILED.splitlines()[4].replace("1_2|1|", "33_2|33|"))
    assert needs_squeue(early, "33")  # old: False, and the array read as a success
    live = read_squeue("33_0|pp-shape-array|COMPLETED|None|vm\n"
                       "33_1|pp-shape-array|FAILED|NonZeroExitCode|vm\n"
                       "33_2|pp-shape-array|COMPLETED|None|vm\n").records
    view = job_view(merge_live(early, live), "33")
    assert (view.state, view.source) == ("FAILED", "squeue")  # provisional: sacct settles it
    assert not needs_squeue(parse_sacct(ARRAY_ONE_FAILED.replace("FAILED|7:0", "RUNNING|0:0")),
                            "1")  # an active array needs nothing more


# local 22.05.8: sacct --jobs=58 while the three tasks of array 58 ran (squeue --array:
# 58_0..58_2 RUNNING), and one round later; the array's own record, named "allocation".
ARRAY_IN_TRANSIT = [
    "58|58|allocation|PENDING|0:0|2026-12-01T10:15:07|2026-12-01T10:15:08|Unknown|0|vm||None",
    "58.batch|58.batch|batch|RUNNING|0:0|2026-12-01T10:15:08|2026-12-01T10:15:08|Unknown|0|vm|"
    "cpu=1,mem=0,node=1|",
]
ARRAY_58_LATER = [
    "58_1|60|pp-dbg-b69c0140|FAILED|7:0|2026-12-01T10:15:07|2026-12-01T10:15:08|"
    "2026-12-01T10:15:10|2|vm|billing=1,cpu=1,node=1|None",
    "58|58|allocation|COMPLETED|0:0|2026-12-01T10:15:07|2026-12-01T10:15:08|"
    "2026-12-01T10:15:10|2|vm||None",  # the shape the old reader took for the whole job
]


def test_an_arrays_own_record_in_transit_is_not_the_array() -> None:
    from operators.slurm.parse import by_name, needs_squeue

    ours = by_name({"58": "pp-dbg-b69c0140"})
    assert read_sacct("\n".join(ARRAY_IN_TRANSIT), ours).records == {}  # not our key's row
    assert needs_squeue(read_sacct("\n".join(ARRAY_IN_TRANSIT), ours).records, "58")
    # Beside task rows, the array's own row does not stand for the array (old: COMPLETED).
    view = job_view(parse_sacct("\n".join(ARRAY_58_LATER)), "58")
    assert (view.state, view.exit_code) == ("FAILED", 7)
    later = read_sacct("\n".join(ARRAY_58_LATER), ours).records
    assert list(later) == ["58_1"]


# -- a requeued job, and sacct behind the controller ---------------------------------------

# local 22.05.8: `sbatch --requeue --wrap 'sleep 30'`, then `scontrol requeue 304`
# (sacct --duplicates --jobs=304): the first run's rows, then the new pending run.
REQUEUED = "\n".join([
    "304|304|wrap|REQUEUED|0:0|2026-12-01T13:00:44|2026-12-01T13:00:45|2026-12-01T13:00:47|2|"
    "vm|billing=1,cpu=1,node=1|None",
    "304.batch|304.batch|batch|CANCELLED|0:15|2026-12-01T13:00:45|2026-12-01T13:00:45|"
    "2026-12-01T13:00:47|2|vm|cpu=1,mem=0,node=1|",
    "304|304|wrap|PENDING|0:0|2026-12-01T13:00:47|Unknown|Unknown|0|None assigned||None",
])


def test_every_run_of_a_requeued_job_is_read_and_the_last_one_counts() -> None:
    assert "--duplicates" in commands.sacct_jobs(["304"])  # else sacct prints the last alone
    job = parse_sacct(REQUEUED)["304"]
    assert (job.state, job.state_detail) == ("PENDING", "requeued after REQUEUED")
    assert (job.exit_code, job.signal) == (0, 0)  # not the first run's batch step (0:15)
    # How a node failure reads when the poll came after the requeue (the few seconds of
    # NODE_FAIL missed): the detail still says it.
    failed = parse_sacct(REQUEUED.replace("|REQUEUED|", "|NODE_FAIL|"))["304"]
    assert failed.state_detail == "requeued after NODE_FAIL"
    # The same id under another name is a reused id, not a second run.
    reused = parse_sacct(REQUEUED.replace("304|304|wrap|PENDING", "304|304|other|PENDING"))
    assert reused["304"].state_detail == ""


def test_a_job_sacct_still_reads_pending_follows_squeue() -> None:
    """The CI failure of session 3: squeue said RUNNING, sacct still PENDING."""
    pending = query.Result(0, REQUEUED.splitlines()[2] + "\n", "")
    running = query.Result(0, "304|wrap|RUNNING|None|vm\n", "")
    found, sent = drive(["304"], pending, running)
    assert [program(s) for s in sent] == ["sacct", "squeue"]
    job = job_view(found.records, "304")
    assert (job.state, job.source, job.nodelist) == ("RUNNING", "squeue", "vm")
    assert job.submit is not None  # sacct's submit time kept
    # Both agree it is pending: still pending.
    found, _ = drive(["304"], pending, query.Result(0, "304|wrap|PENDING|Priority|\n", ""))
    assert job_view(found.records, "304").state == "PENDING"

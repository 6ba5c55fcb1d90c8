"""``make test``: the whole suite in lanes, several at once, so that the stories that mostly
wait (on Slurm queues, Airflow's scheduler, a server's restart) wait side by side.

    python -m tests.lanes [PYTEST_ARGS...]

With arguments this is plain pytest (a developer's selection runs as asked). Without, it runs

  phase 1, at once:  the production stack's story (tests/stack: its own PostgreSQL, Redis,
                     Celery workers, triggerers, MLflow and S3 server, on its own ports),
                     every other test that does not disturb the cluster, in two lanes split by
                     path (LANE_A_TESTS, LANE_B_TESTS and the rest), and the ``fault_nodes``
                     tests, which set down and cut off only the nodes of the cluster's
                     ``faults`` partition, where no other test runs a job;
  phase 2, alone:    the ``disruptive`` tests: they stop slurmdbd or sshd, set nodes down, cut
                     a node's link or make the login shell print a banner, and would break what
                     runs beside them. Which tests those are is checked (tests/test_lanes.py).

Each lane is its own pytest process with its own session fixtures (the lanes share no port:
the stack listens on 196xx, the other stories on 18xxx). The exit status is non-zero when any
lane fails; the last lane of a phase streams its output, the others' is printed when they end.
Most of the suite waits (on Slurm, Airflow's scheduler, a server), so four lanes on two cores
take far less wall time than one, at the price of a higher load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tests.support.airflow import SESSION_PORT, SESSION_PORT_ENV
from tests.support.tiers import DISRUPTIVE, FAULT_NODES

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
STACK_TESTS = "tests/stack"
SUMMARY = re.compile(r"^=*\s*(.*\b(passed|failed|error|errors|no tests ran)\b.*?)\s*=*$")


@dataclass(frozen=True)
class Lane:
    name: str
    args: tuple[str, ...]
    durations: int = 30
    # The port of this lane's session ``standalone`` (tests/conftest.py reads it from
    # PP_TEST_AIRFLOW_PORT; its log servers take +10000 and +10001). Every lane that runs a
    # module using that fixture has a port of its own, so two lanes' Airflows never collide
    # (tests/test_lanes.py checks it); None for a lane that runs none of them.
    airflow_port: int | None = None


# What each lane of phase 1 takes, by path; lane B also runs every test no lane takes. A lane
# that runs modules using the session's ``airflow standalone`` starts its own, on the lane's
# ``airflow_port``; the stories with an Airflow of their own have their own ports, and the
# MLflow/S3 servers take free ones. A module never splits: its fixtures stay in one process.
# The balance comes from the lanes' JUnit reports (the summary prints each lane's slowest
# modules). Session 9's fresh-clone run here, at load 7-9: stack 1419 s, lane A 2450 s, lane B
# ~2200 s with its fault story passing; then the three stories gated until they had passed
# (the health stories, ~15 min, in lane A, which needs the session Airflow) joined, so the
# export/evaluation jobs (~540 s) and the Airflow-down story (its own Airflow) moved to the
# stack's lane and tests/campaign to lane B.
STACK_LANE_TESTS = (STACK_TESTS, "tests/preflight/test_bridge_preflight.py",
                    "tests/pipeline/test_prequeue_airflow_down.py", "tests/export_eval")
LANE_A_TESTS = ("tests/pipeline", "tests/slurm", "tests/tracking")
LANE_B_TESTS = ("tests/pipeline/test_campaign_faults.py",)
NOT_DISRUPTIVE = ("-m", f"not {DISRUPTIVE}")
ON_SHARED_NODES = ("-m", f"not {DISRUPTIVE} and not {FAULT_NODES}")
# The fault partition's node-failure stories (~16 min, mostly Slurm's own timers: a cut-off
# node is declared down SlurmdTimeout after its last answer) ran alone in phase 2 until they
# had nodes of their own.
FAULT_NODES_LANE = "faults"
FAULT_NODES_AIRFLOW_PORT = 18380  # its stories under a real triggerer (log servers +10000, +10001)
TESTS_DIR = Path(__file__).parent


def _ignoring(*paths: str) -> tuple[str, ...]:
    return tuple(f"--ignore={path}" for path in paths)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path.startswith(f"{root}/") for root in roots)


def taking(takes: tuple[str, ...], elsewhere: tuple[str, ...]) -> tuple[str, ...]:
    """A lane's pytest paths: what it takes, less what other lanes take from inside it."""
    return (*takes, *_ignoring(*(path for path in elsewhere if _inside(path, takes))))


def the_rest(taken: tuple[str, ...], own: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every entry of tests/ that no lane takes whole (less what they take from inside it),
    then ``own``: paths pytest would not collect under a ``--ignore`` of their directory."""
    root = TESTS_DIR.name
    entries = sorted(f"{root}/{entry.name}" for entry in TESTS_DIR.iterdir()
                     if (entry.is_dir() and entry.name not in {"__pycache__", "support"}
                         and any(entry.rglob("test_*.py")))
                     or (entry.is_file() and entry.name.startswith("test_")
                         and entry.suffix == ".py"))
    rest = tuple(entry for entry in entries if entry not in taken)
    return (*rest, *own, *_ignoring(*(path for path in taken if _inside(path, rest))))


PHASE_1 = (Lane(FAULT_NODES_LANE, ("tests", "-m", f"{FAULT_NODES} and not {DISRUPTIVE}"),
                durations=5, airflow_port=FAULT_NODES_AIRFLOW_PORT),
           Lane("stack", (*taking(STACK_LANE_TESTS, (*LANE_A_TESTS, *LANE_B_TESTS)),
                          *ON_SHARED_NODES), durations=10),
           Lane("main-b", (*the_rest((*STACK_LANE_TESTS, *LANE_A_TESTS), LANE_B_TESTS),
                           *ON_SHARED_NODES), durations=20),
           Lane("main-a", (*taking(LANE_A_TESTS, (*STACK_LANE_TESTS, *LANE_B_TESTS)),
                           *ON_SHARED_NODES), airflow_port=SESSION_PORT))
PHASE_2 = (Lane(DISRUPTIVE, ("tests", "-m", DISRUPTIVE), durations=15),)
# Each lane's JUnit report (per-test times: where the next rebalancing starts), kept after the
# run; the summary prints each lane's slowest modules from it.
REPORTS = Path(os.environ.get("PP_LANES_REPORTS", Path(__file__).parent.parent / "build" / "lanes"))


@dataclass
class Finished:
    lane: Lane
    rc: int
    seconds: float
    summary: str


# A lane's notes: what its tests recovered from and want CI's tail to show anyway (a fixture
# that retried a service's start-up says why the first try failed). One line each.
NOTES_ENV = "PP_LANES_NOTES"


def note(text: str) -> None:
    """Add a line to this lane's notes (printed in the summary); outside a lane, to stderr."""
    line = " ".join(text.split())[:500]
    path = os.environ.get(NOTES_ENV)
    if not path:
        print(f"[note] {line}", file=sys.stderr)
        return
    with open(path, "a") as notes:
        notes.write(line + "\n")


def notes_of(lane: Lane) -> list[str]:
    try:
        return (REPORTS / f"{lane.name}.notes").read_text().splitlines()
    except OSError:
        return []


def summary_of(output: str) -> str:
    """pytest's last ``N passed, M failed in Xs`` line, or what was seen instead."""
    for line in reversed(output.splitlines()):
        found = SUMMARY.match(line.strip())
        if found:
            return found.group(1)
    return "no pytest summary"


def _env(lane: Lane) -> dict[str, str]:
    notes = REPORTS / f"{lane.name}.notes"
    notes.unlink(missing_ok=True)
    port = {SESSION_PORT_ENV: str(lane.airflow_port)} if lane.airflow_port else {}
    return {**os.environ, NOTES_ENV: str(notes), **port}


def _argv(lane: Lane) -> list[str]:
    return [*PYTEST, f"--durations={lane.durations}", f"--junitxml={REPORTS / lane.name}.xml",
            *lane.args]


def module_seconds(junit_xml: str) -> Counter[str]:
    """Seconds per test module (set-up and teardown included, as JUnit's testcase times count
    them) from a pytest JUnit report."""
    seconds: Counter[str] = Counter()
    for case in ET.fromstring(junit_xml).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.pipeline.test_x[.TestClass]
        ends = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        seconds["/".join(parts[:ends + 1]) + ".py"] += float(case.get("time", 0))
    return seconds


def slowest_modules(lane: Lane, top: int = 6) -> str:
    try:
        seconds = module_seconds((REPORTS / f"{lane.name}.xml").read_text())
    except (OSError, ET.ParseError):
        return "no report"
    return ", ".join(f"{module} {s:.0f}s" for module, s in seconds.most_common(top))


def failures(junit_xml: str) -> list[tuple[str, str]]:
    """(test id, its failure or error message's first line, and its last when it has more)
    for every failed or errored test case of a JUnit report: what CI's tail must show, since
    the tracebacks scroll away. The last line too, because a wrapped error ("local_stack.sh up
    failed:" and the script's output) says why only at its end."""
    found = []
    for case in ET.fromstring(junit_xml).iter("testcase"):
        for problem in (*case.iter("failure"), *case.iter("error")):
            lines = _exception_lines(problem.text or "") or _lines(problem.get("message") or "")
            summary = " ... ".join(lines[:1] + lines[-1:] * (len(lines) > 1)) or problem.tag
            found.append((f"{case.get('classname', '')}::{case.get('name', '')}",
                          summary[:500]))
    return found


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _exception_lines(report: str) -> list[str]:
    """The exception's own lines of a pytest report (its ``E   `` lines, the last block of
    them): the whole message. JUnit's ``message`` attribute is cut after some lines ("[+14 more
    lines; full report in element text]"), which is where a wrapped error says why."""
    blocks: list[list[str]] = []
    previous_was_e = False
    for line in report.splitlines():
        is_e = line.startswith("E ")
        if is_e and not previous_was_e:
            blocks.append([])
        if is_e:
            blocks[-1].append(line[1:])
        previous_was_e = is_e
    return _lines("\n".join(blocks[-1])) if blocks else []


def failure_lines(lane: Lane, top: int = 8) -> list[str]:
    """The lane's failures for the summary: each distinct message once, with the first test
    that met it and how many more did (a module fixture's error repeats for all its tests)."""
    try:
        found = failures((REPORTS / f"{lane.name}.xml").read_text())
    except (OSError, ET.ParseError):
        return []
    by_message: dict[str, list[str]] = {}
    for test, message in found:
        by_message.setdefault(message, []).append(test)
    lines = [f"{tests[0]}{f' (+{len(tests) - 1} more)' * (len(tests) > 1)}: {message}"
             for message, tests in by_message.items()]
    return lines[:top] + [f"... and {len(lines) - top} more messages"] * (len(lines) > top)


def run_phase(lanes: tuple[Lane, ...]) -> list[Finished]:
    """Start every lane; the last one streams to this terminal, the others to files."""
    *quiet, loud = lanes
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pp-lanes-") as tmp:
        logs = {lane.name: Path(tmp) / f"{lane.name}.log" for lane in quiet}
        procs = {}
        for lane in quiet:
            with open(logs[lane.name], "w") as out:
                procs[lane.name] = subprocess.Popen(_argv(lane), stdout=out, env=_env(lane),
                                                    stderr=subprocess.STDOUT)
        background = f": {', '.join(lane.name for lane in quiet)} in the background" * bool(quiet)
        print(f"[lanes] {' + '.join(lane.name for lane in lanes)}{background}", flush=True)
        loud_proc = subprocess.Popen(_argv(loud), stdout=subprocess.PIPE, env=_env(loud),
                                     stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        for line in loud_proc.stdout:
            sys.stdout.write(line)
            tail = [*tail[-200:], line]
        finished = [Finished(loud, loud_proc.wait(), time.monotonic() - started,
                             summary_of("".join(tail)))]
        for lane in quiet:
            rc = procs[lane.name].wait()
            output = logs[lane.name].read_text(errors="replace")
            print(f"\n[lanes] ----- lane {lane.name} (rc {rc}) -----", flush=True)
            sys.stdout.write(output)
            finished.append(Finished(lane, rc, time.monotonic() - started, summary_of(output)))
    return finished


def main(argv: list[str]) -> int:
    if argv:  # a selection: as asked, one process
        return subprocess.call([*PYTEST, "--durations=30", *argv])
    started = time.monotonic()
    REPORTS.mkdir(parents=True, exist_ok=True)
    results = [*run_phase(PHASE_1), *run_phase(PHASE_2)]
    print("\n[lanes] summary", flush=True)
    for result in results:
        print(f"[lanes]   {result.lane.name:<11} rc {result.rc}  {result.summary}", flush=True)
        print(f"[lanes]   {'':<11} slowest: {slowest_modules(result.lane)}", flush=True)
        for line in failure_lines(result.lane):
            print(f"[lanes]   {'':<11} FAILED {line}", flush=True)
        for line in notes_of(result.lane):
            print(f"[lanes]   {'':<11} NOTE {line}", flush=True)
    print(f"[lanes] whole suite in {time.monotonic() - started:.0f}s", flush=True)
    # pytest's 5 (nothing collected) fails too: a lane that selects nothing is a broken lane.
    return 0 if all(result.rc == 0 for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

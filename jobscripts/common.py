"""Plumbing shared by the entry points: the job log and the result-JSON contract.

Every entry point writes its result JSON (``"ok": true`` plus its figures, or
``"ok": false`` plus a human-readable ``"error"``) even when it fails, and exits
non-zero on failure, so the Airflow side never has to scrape the log to learn why.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jobscripts.results import write_json_atomic


class StepError(Exception):
    """A failure whose message already names the file, line or field at fault.

    ``details`` goes into the result JSON next to the error (a gate puts its
    per-expectation figures there, so a failing gate still reports everything).
    """

    def __init__(self, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = details or {}


def log(message: str) -> None:
    # stdout is the Slurm job log, streamed into the Airflow task log: flush each line.
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_step(
    step: str,
    args: argparse.Namespace,
    default_result: Path,
    body: Callable[[argparse.Namespace], dict[str, Any]],
) -> int:
    """Run ``body``, write its result JSON atomically, and turn failures into exit 1."""
    result_path = Path(args.result) if getattr(args, "result", None) else default_result
    started = time.monotonic()
    try:
        payload = body(args)
    except StepError as exc:
        payload = {**exc.details, "ok": False, "error": str(exc)}
        log(f"{step} FAILED: {exc}")
    except Exception as exc:  # anything unforeseen still leaves a result behind
        traceback.print_exc()
        payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        log(f"{step} FAILED: {payload['error']}")
    else:
        payload = {**payload, "ok": True}
    payload["step"] = step
    payload["seconds"] = round(time.monotonic() - started, 3)
    write_json_atomic(result_path, payload)
    log(f"{step}: result written to {result_path}")
    return 0 if payload["ok"] else 1


def entry_point(
    step: str,
    build_parser: Callable[[], argparse.ArgumentParser],
    body: Callable[[argparse.Namespace], dict[str, Any]],
    result_name: str,
    result_dir: Callable[[argparse.Namespace], str] = lambda args: args.output_dir,
) -> Callable[[list[str] | None], int]:
    """``main(argv) -> exit code`` for a step: its flags plus ``--result``, then run_step."""

    def main(argv: list[str] | None = None) -> int:
        parser = build_parser()
        parser.add_argument(
            "--result", help=f"where to write the result JSON (default: <output dir>/{result_name})"
        )
        args = parser.parse_args(argv)
        return run_step(step, args, Path(result_dir(args)) / result_name, body)

    return main


def process_group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (signal 0 checks without sending)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc's ``starttime``), or None
    when there is no such process: with its PID, it names one process, not a reused PID."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def recorded_group_alive(pgid: int, leader_started: int) -> bool:
    """Whether the process group a record names (its leader's PID and start time) still runs.

    Its leader still there, with the recorded start time; or gone while the group still has
    members (the kernel never hands out a PID that names a live group, so a group without
    its leader is still the one recorded). A live leader with another start time is a stranger
    that was given the PID after the group ended: not ours to signal."""
    if not process_group_alive(pgid):
        return False
    started = process_start_ticks(pgid)
    return started is None or started == leader_started


def stop_process_group(pgid: int, steps: Iterable[tuple[int, float]]) -> bool:
    """Each (signal, seconds) of ``steps`` in turn to the whole group ``pgid``, waiting up to
    those seconds for every process of it to end before the next: a leader that exits on the
    first signal may leave children that need the second. Whether the group is gone."""
    for sig, wait in steps:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and process_group_alive(pgid):
            time.sleep(0.5)
    return not process_group_alive(pgid)

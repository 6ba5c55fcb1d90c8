"""The start gate of a pre-queued training segment job (docs/prequeue.md).

    python -m jobscripts.segment_gate --after-dir RUN_DIR --checkpoints ROOT
        --train-iters N [--segment-result segment.json]

A pre-queued segment was submitted while the segment before it still ran, with a Slurm
dependency ``afterok`` on that job: Slurm itself never starts it after a job that failed,
was cancelled or hit its time limit (and ``--kill-on-invalid-dep`` then removes it). What
Slurm cannot see is the campaign's progress rule: a job that exited 0 without advancing the
checkpoint tracker (Airflow fails that segment without retry, ``plan.check_progress``). So
this runs first in the pre-queued job's script and lets the trainer start only when

1. the segment before left its ``segment.json`` in its run dir (``--after-dir``),
2. with a stop reason of a segment that ended as planned (completed, time limit, signal),
3. and the tracker under ``--checkpoints`` is past that segment's ``start_iteration``,
4. and below ``--train-iters`` (otherwise there is nothing left to train).

Otherwise it writes this job's ``segment.json`` with stop reason ``prequeue_refused`` and
the rule that failed, and exits :data:`EXIT_REFUSED`: the job never trains from the same
checkpoint again. Standard library only: the gate runs on the host before any container.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jobscripts.checkpoints import read_tracker
from jobscripts.job_files import SEGMENT_RESULT
from jobscripts.results import write_json_atomic
from jobscripts.vocabulary import COMPLETED, PREQUEUE_REFUSED, SIGNAL, TIME_LIMIT

# The job's exit status when the gate refuses; Slurm records it as FAILED with exit code 3
# (the trainers exit 1 on a failure and 2 on a bad config).
EXIT_REFUSED = 3
PLANNED_ENDS = (COMPLETED, TIME_LIMIT, SIGNAL)
PREFIX = "[segment_gate]"


def decide(before: dict | None, tracker: int | None, train_iters: int) -> str | None:
    """Why the job must not train (None: it may). ``before``: the previous segment's
    ``segment.json`` (None when missing or unreadable); ``tracker``: the checkpoint tracker's
    iteration now (None before the first save)."""
    if before is None:
        return "the segment before left no readable segment.json"
    reason = before.get("stop_reason")
    if reason not in PLANNED_ENDS:
        return f"the segment before stopped {reason!r}: {before.get('error') or 'no detail'}"
    start = before.get("start_iteration") or 0
    if not isinstance(start, int) or isinstance(start, bool):
        return f"the segment before has no start_iteration (got {start!r})"
    now = tracker or 0
    if now <= start:
        return (f"the segment before made no progress: the checkpoint tracker is at {now}, "
                f"it started at {start}")
    if now >= train_iters:
        return f"the campaign is done: the checkpoint tracker is at {now} >= {train_iters}"
    return None


def _read(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def refused_result(detail: str, tracker: int | None, train_iters: int) -> dict:
    """This job's segment.json when it refuses (the trainers' shape, nothing trained)."""
    return {"start_iteration": tracker, "end_iteration": tracker, "train_iters": train_iters,
            "stop_reason": PREQUEUE_REFUSED, "stop_detail": detail, "checkpoint": None,
            "resumed_from": None, "saves": 0, "save_seconds": 0.0, "load_seconds": 0.0,
            "tokens_consumed": 0, "train_seconds": 0.0, "elapsed_seconds": 0.0,
            "error": f"pre-queued segment refused to train: {detail}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobscripts.segment_gate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--after-dir", required=True, help="the previous segment's run dir")
    parser.add_argument("--checkpoints", required=True, help="the campaign's checkpoint root")
    parser.add_argument("--train-iters", required=True, type=int)
    parser.add_argument("--segment-result", default=SEGMENT_RESULT,
                        help="this job's segment.json (relative: the working directory)")
    args = parser.parse_args(argv)
    tracker = read_tracker(args.checkpoints)
    why = decide(_read(Path(args.after_dir) / SEGMENT_RESULT), tracker, args.train_iters)
    if why is None:
        print(f"{PREFIX} go: the segment before advanced the checkpoint to {tracker}",
              flush=True)
        return 0
    write_json_atomic(args.segment_result, refused_result(why, tracker, args.train_iters))
    print(f"{PREFIX} refused ({PREQUEUE_REFUSED}, exit {EXIT_REFUSED}): {why}", flush=True)
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())

"""One task of a data-stage job array (ingest, tokenization): which task, its result file.

Both stages run as a Slurm job array of N tasks plus one merge job. Task I is
``--array-task I``, else ``$SLURM_ARRAY_TASK_ID``; the tasks share the job's run directory,
so each writes its own result file (``result.json`` -> ``result_I.json``), which the
operator reads to name a failed task and its shards (operators/campaign/dag/stage_operator.py
``task_result_name``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from jobscripts.common import StepError


def resolve_task(given: int | None, tasks: int) -> int:
    """This job's array task: ``given``, else Slurm's ``SLURM_ARRAY_TASK_ID``."""
    task = given if given is not None else int(os.environ.get("SLURM_ARRAY_TASK_ID", "-1"))
    if not 0 <= task < tasks:
        raise StepError(f"--array-tasks {tasks}: array task {task} is not in "
                        f"0..{tasks - 1} (set --array-task or SLURM_ARRAY_TASK_ID)")
    return task


def task_result_path(result: str, task: int) -> str:
    """An array task's own result file: ``result.json`` -> ``result_3.json``."""
    path = Path(result)
    return str(path.with_name(f"{path.stem}_{task}{path.suffix}"))


def add_array_arguments(p: argparse.ArgumentParser, task_help: str, merge_help: str) -> None:
    """``--array-tasks N`` (this job is one of N array tasks) or ``--merge-tasks N`` (the job
    after them), and ``--array-task I``: the same flags for every stage that runs as an
    array."""
    tasks = p.add_mutually_exclusive_group()
    tasks.add_argument("--array-tasks", type=int, metavar="N", help=task_help)
    tasks.add_argument("--merge-tasks", type=int, metavar="N", help=merge_help)
    p.add_argument("--array-task", type=int, metavar="I",
                   help="this array task (default: $SLURM_ARRAY_TASK_ID)")


def resolve_array_args(p: argparse.ArgumentParser, args: argparse.Namespace,
                       default_result: Path) -> None:
    """The array flags checked (a task count below one is a usage error naming its flag) and,
    for an array task, its id and its own result file (``--result``, or ``default_result``,
    with ``_<task>`` added) set on ``args``."""
    for flag in ("array_tasks", "merge_tasks"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.array_tasks:
        try:
            args.array_task = resolve_task(args.array_task, args.array_tasks)
        except StepError as exc:
            p.error(str(exc))
        args.result = task_result_path(args.result or str(default_result), args.array_task)

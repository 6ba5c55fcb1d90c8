"""Pre-queued segments (docs/prequeue.md): while segment N's job runs, the next
``segments.prequeue_depth`` segments' jobs are already in Slurm's queue, each ``afterok`` on
the one before, each under exactly the job key its own task computes, so that task
re-attaches to it instead of submitting. The chain then goes on while Airflow is down.

Why ``afterok`` and not ``afterany``: Slurm then never starts a pre-queued segment after a
job that failed, was cancelled (its task marked failed or cleared: the trigger's scancel) or
hit its hard time limit; with ``--kill-on-invalid-dep=yes`` (operators/slurm/render.py) Slurm
removes the whole rest of the chain at once. What Slurm cannot see, a job that exited 0
without advancing the checkpoint, the job's own gate refuses at its start
(jobscripts/segment_gate.py). A segment that ends by the hard limit (TIMEOUT, which the task
counts as success) thus loses its pre-queued successor: that successor's task submits its
own job, as without pre-queueing.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from jobscripts.job_files import SEGMENT_RESULT
from operators.slurm.messages import JobRequest
from operators.slurm.operator import python_module_command

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

GATE_MODULE = "jobscripts.segment_gate"
XCOM_PREQUEUED = "segment_prequeued"  # on segment N's task: the jobs it pre-queued


def dependency(job_id: str) -> str:
    """The Slurm dependency of a segment pre-queued behind job ``job_id`` (module doc)."""
    return f"afterok:{job_id}"


def gate_command(after_dir: str, checkpoints: str, train_iters: int) -> str:
    """The gate's line, every value shell-quoted: paths come from the campaign (data)."""
    return python_module_command(GATE_MODULE, "--after-dir", after_dir, "--checkpoints",
                                 checkpoints, "--train-iters", train_iters,
                                 "--segment-result", SEGMENT_RESULT)


def gated(request: JobRequest, after_job: str, after_dir: str, checkpoints: str,
          train_iters: int) -> JobRequest:
    """``request`` as a pre-queued job: after ``after_job`` (in ``after_dir``), its gate
    first. The batch script runs under ``set -e``, so a refusal ends it with the gate's exit
    status before the command's own first line (cluster.setup included)."""
    gate = gate_command(after_dir, checkpoints, train_iters)
    return replace(request, command=f"{gate}\n{request.command}",
                   job={**request.job, "dependency": dependency(after_job)})


def successors(campaign: Campaign, segment: int, before: int, train_iters: int,
               allowed: int, depth: int) -> list[int]:
    """The segments to pre-queue behind ``segment``, which starts at iteration ``before``:
    at most ``depth``, none past ``allowed`` (the run's segments_per_run) and, when the
    campaign cuts segments at ``iters_per_segment``, none that would start at or past
    ``train_iters``. Without that grid how far a segment gets is unknown: the gate refuses
    a pre-queued segment of a campaign that is done."""
    per = campaign.segments.iters_per_segment
    found, position = [], before
    for k in range(1, depth + 1):
        if segment + k > allowed:
            break
        if per is not None:
            position = min(train_iters, (position // per + 1) * per)  # where N+k-1 stops
            if position >= train_iters:
                break
        found.append(segment + k)
    return found


@dataclass(frozen=True)
class Prequeued:
    """One pre-queued job, as segment N's task pushes it (XCom, a list of these)."""

    segment: int
    key: str
    job_id: str
    after_job: str
    by_segment: int  # the segment whose task queued it

    def to_json(self) -> dict:
        return {"segment": self.segment, "key": self.key, "job_id": self.job_id,
                "after_job": self.after_job, "by_segment": self.by_segment}


def describe(prequeued: list[Prequeued]) -> str:
    return ", ".join(f"segment {p.segment} as job {p.job_id} ({dependency(p.after_job)})"
                     for p in prequeued) or "nothing"


def clear_result(run_dir: str) -> str:
    """The command that removes a stale segment.json (an earlier try's) from ``run_dir``
    before its job is queued: the gate of the segment after it must never read that one."""
    return "rm -f -- " + shlex.quote(posixpath.join(run_dir, SEGMENT_RESULT))


def waits_for(script: str, job_id: str) -> bool:
    """Whether a pre-queued job's batch script (its ``job.sbatch``) queues it behind
    ``job_id``. A successor found under its key that waits for another job (an earlier try's,
    since cancelled: its task was cleared) is about to be removed by Slurm
    (``--kill-on-invalid-dep``) and must not be taken for this try's successor. The line is
    render.py's directive for :func:`dependency`."""
    return f"#SBATCH --dependency={dependency(job_id)}" in script.splitlines()

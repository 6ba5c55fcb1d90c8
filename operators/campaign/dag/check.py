"""Check campaign files before they reach the DAG folder; print each one's plan.

    pretrain-pipeline check FILE [FILE ...]

Each file is loaded and its DAG built by exactly the code the DAG file runs
(operators/campaign/dag/folder.py). A problem prints as ``file:line: field: message``; a valid
campaign prints its plan: segments and their exit duration, tokens, epochs over the dataset,
tokens per parameter, and what each stage will request from Slurm. Exits 1 if any file has
a problem, so it serves a pre-commit hook or a CI job of the team's campaign repository.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

HELP = "validate campaign YAML files as the DAG file does, and print each one's plan"
# sbatch options worth showing, in the order a reader compares them.
REQUEST_KEYS = ("partition", "account", "qos", "nodes", "ntasks_per_node", "gpus_per_node",
                "cpus_per_task", "mem", "time", "exclusive", "signal", "requeue")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", type=Path,
                        help="campaign YAML files")


def _request(job: dict[str, Any]) -> str:
    from operators.slurm.operator import plain

    job = plain(job)
    return " ".join(f"{k}={job[k]}" for k in REQUEST_KEYS if job.get(k) not in (None, False))


def segment_request(campaign: Campaign) -> dict[str, Any]:
    """What a training segment asks Slurm for (rendered when the task runs, so here the same
    functions the segment operator calls compute it)."""
    from operators.campaign.render.plan import segment_job_options
    from operators.campaign.render.stages import stage_job

    if campaign.model.reference is not None:
        return {**stage_job(campaign), **segment_job_options(campaign, batch_shell=True)}
    from operators.campaign.render.bridge import bridge_job
    from operators.campaign.render.paths import RunInputs

    return bridge_job(campaign, RunInputs())[0]


def preflight_request(campaign: Campaign) -> dict[str, Any]:
    """What ``train.preflight`` asks Slurm for, by the functions its operator calls."""
    from operators.campaign.dag import preflight
    from operators.campaign.render.layout import Layout
    from operators.campaign.render.paths import RunInputs

    layout = Layout.for_campaign(campaign)
    return dict(preflight.preflight_request(campaign, layout,
                                            RunInputs.stand_in(campaign, layout), []).job)


def plan_lines(campaign: Campaign, dag) -> list[str]:
    from operators.campaign.dag.preflight import PreflightOperator
    from operators.campaign.dag.segment import TrainingSegmentOperator
    from operators.campaign.render.plan import plan_segments, segment_exit_minutes
    from operators.campaign.render.summary import summary
    from operators.slurm.operator import SlurmJobOperator

    c, s = campaign, campaign.segments
    plan = plan_segments(c, 0)
    targets = ", ".join(str(t.target_iteration) for t in plan.segments)
    lines = [f"DAG {dag.dag_id}: {len(dag.tasks)} tasks",
             f"Segment plan: a first DAG run submits {len(plan.segments)}, stopping at "
             f"iteration {targets} at the latest; each exits after "
             f"{segment_exit_minutes(c)} min of training "
             f"(time limit {c.cluster.time_limit_minutes} min - start-up "
             f"{s.startup_estimate_min:g} min - save {s.save_estimate_s:g} s - margin "
             f"{s.margin_min:g} min, rounded down)"]
    for row in summary(c).splitlines():  # the DAG's own doc: tokens, epochs, tokens/param
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if row.startswith("| ") and len(cells) == 2 and cells[0]:
            lines.append(f"{cells[0]}: {cells[1].replace('`', '')}")
    lines.append("Slurm requests:")
    for task in dag.tasks:
        if isinstance(task, TrainingSegmentOperator):
            lines.append(f"  {task.task_id}: {_request(segment_request(c))}")
        elif isinstance(task, PreflightOperator):
            lines.append(f"  {task.task_id}: {_request(preflight_request(c))}")
        elif isinstance(task, SlurmJobOperator):
            lines.append(f"  {task.task_id}: {_request(task.job)}")
    return lines


def check_file(path: Path, out: TextIO) -> bool:
    """Print ``path``'s problems or its plan; True when it is a valid campaign."""
    from operators.campaign.dag.folder import build_one, build_own, is_campaign_file, own_dag_file
    from operators.campaign.schema.load import CampaignConfigError, Problem

    shown = str(path)
    if not is_campaign_file(path):
        print(Problem("", "not a campaign file (a visible, readable *.yaml or *.yml file)")
              .located(shown), file=out)
        return False
    # What the DAG file runs for this campaign file, with this path in the messages: its own
    # DAG file's code when it has one (x.py beside x.yaml), the folder DAG file's otherwise.
    build = build_own if own_dag_file(path).is_file() else build_one
    try:
        campaign, dag = build(path, shown)
    except CampaignConfigError as exc:
        for problem in exc.problems:
            print(problem.located(shown), file=out)
        return False
    print(f"{shown}: ok", file=out)
    for line in plan_lines(campaign, dag):
        print(f"  {line}", file=out)
    return True


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    results = [check_file(path, out) for path in args.files]
    return 0 if all(results) else 1

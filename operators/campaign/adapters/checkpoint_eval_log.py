"""A per-checkpoint evaluation in MLflow: figures on the campaign's run at step = iteration.

The evaluation DAG's ``evaluate`` task (operators/campaign/dag/eval_dag.py) gets a child run
of the campaign's run (``pp.stage`` = ``evaluate_checkpoint``) with its job, log and result;
each checkpoint's perplexity, bits per byte, nll and tokens evaluated (the final evaluate's
names, operators/tracking/registry.py) plus ``eval_tokens_consumed`` (the tokens trained on
up to that checkpoint: iteration x global batch x sequence length) go to the child and to
the parent at step = the checkpoint's iteration, so MLflow draws the evaluation curve beside
the loss. Every value carries the job's start as its timestamp: a retried task sends the
same points again, which MLflow keeps once.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from operators.campaign.adapters import tracking
from operators.tracking import names

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.render.layout import Layout
    from operators.campaign.schema.config import Campaign
    from operators.slurm.hook import SlurmHook
    from operators.slurm.messages import JobSummary

STAGE = "evaluate_checkpoint"
EVAL_TOKENS_CONSUMED = "eval_tokens_consumed"
RESULT_ARTIFACT = "eval/checkpoint_evals.json"


def tokens_at(campaign: Campaign, iteration: int) -> int:
    """Tokens trained on up to ``iteration`` (a constant global batch: the schema's)."""
    t = campaign.training
    return iteration * t.global_batch_size * t.seq_length


def checkpoint_values(campaign: Campaign, iteration: int, result: dict) -> dict[str, float]:
    from operators.tracking.registry import eval_metrics

    values = eval_metrics(result) if result.get("ok") else {}
    if values:
        values[EVAL_TOKENS_CONSUMED] = float(tokens_at(campaign, iteration))
    return values


def log_checkpoint_evals(campaign: Campaign, hook: SlurmHook, layout: Layout,
                         context: Context, summary: JobSummary, status: str) -> None:
    tracker = tracking.open_tracker(campaign)
    if tracker is None:
        return
    tracker.flush()
    # Not re-opened: this evaluation may end after the campaign's DAG run, whose end (the
    # listener) is the only thing that sets the run FINISHED (seen: the demo's run left RUNNING).
    parent = tracking.campaign_run(tracker, campaign, hook, layout, reopen=False)
    child = tracking._task_child(tracker, parent, context["ti"],  # noqa: SLF001 - same family
                                 {names.KIND_TAG: names.STAGE_KIND, names.STAGE_TAG: STAGE})
    result = summary.result or {}
    stamp = tracking._job_start_ms(summary)  # noqa: SLF001
    for key, one in sorted((result.get("checkpoints") or {}).items(), key=lambda i: int(i[0])):
        values = checkpoint_values(campaign, int(key), one)
        for run_id in (child, parent):
            if values:
                tracker.log_values(run_id, values, int(key), timestamp_ms=stamp)
    tracking._log_job(tracker, child, hook, summary,  # noqa: SLF001
                      {RESULT_ARTIFACT: json.dumps(result, indent=2, sort_keys=True)},
                      status=status)

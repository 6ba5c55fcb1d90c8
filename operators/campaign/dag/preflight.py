"""``train.preflight``: one short job that decides "this config will run", before any training job.

Every campaign has it, first in the ``train`` group. It renders exactly what segment 1 would get
(the same renderers: operators/campaign/render/bridge.py, reference.py) and runs the
path's own checks on the cluster, where the files are:

- Bridge campaigns: ``jobscripts.bridge_preflight`` in the training image (the campaign's
  container; a CPU job, no GPUs), with the training's environment (HF_HOME, offline): recipe by
  name, the YAML and CLI overrides through Bridge's override path in strict mode, Bridge's
  validation for the job's world size, data, tokenizer, checkpoint dir, mixed precision, FP8.
- reference campaigns: ``jobscripts.reference_preflight`` with the cluster's Python.

A failed preflight fails the task with the job's own message (it names the key) and is never
retried: a configuration error does not go away by itself. The segments then never submit.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from operators.campaign.adapters.code_ship import ShipsCode, with_code
from operators.campaign.adapters.remote import read_history, read_iteration, read_text
from operators.campaign.render.layout import RESULT_FILE, Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.render.placement import (
    export_lines,
    in_container,
    setup_lines,
    stage_command,
    stage_launch,
)
from operators.slurm.messages import JobRequest
from operators.slurm.operator import SlurmJobOperator

if TYPE_CHECKING:
    from airflow.sdk import Context

    from operators.campaign.schema.config import Campaign
    from operators.slurm.errors import SlurmJobFailed
    from operators.slurm.hook import SlurmHook
    from operators.slurm.messages import JobSummary

TASK_ID = "preflight"


def _data_prefixes(hook: SlurmHook, layout: Layout) -> list[str] | None:
    """The prefixes segment 1 will train on when the data stage made them (its manifest);
    None where the campaign names its own (prefixes or blend: the renderers take those)."""
    from jobscripts import manifest as manifests

    text = read_text(hook, layout.manifest)
    if text is not None:
        return manifests.data_prefixes(json.loads(text), layout.tokens)
    return None


def bridge_preflight_job(campaign: Campaign, layout: Layout, inputs: RunInputs,
                         history: list[dict]) -> JobRequest:
    """Segment 1's YAML and environment, checked in the training image (the ``preflight``
    placement: operators/campaign/render/placement.py)."""
    from operators.campaign.render.bridge import BASE_ENVIRONMENT, CONFIG_FILE, bridge_segment

    segment = bridge_segment(campaign, layout, inputs, history)
    launch = stage_launch(campaign, "preflight")
    module = ["-m", "jobscripts.bridge_preflight", "--recipe", campaign.model.recipe,
              "--config-file", CONFIG_FILE, "--world-size", str(campaign.world_size),
              "--result", RESULT_FILE]
    # The training container's environment as the segment's inner command has it
    # (bridge.py): the defaults (HF_HUB_OFFLINE=1 ...) unless the campaign sets them.
    given = {**campaign.cluster.environment, **(launch.environment or {})}
    lines = export_lines({k: v for k, v in BASE_ENVIRONMENT.items() if k not in given})
    if inputs.code_dir is not None:  # set inside: the image's own PYTHONPATH would win
        lines.append(f"export PYTHONPATH={shlex.quote(inputs.code_dir)}"
                     "${PYTHONPATH:+:$PYTHONPATH}")
    lines.append(" ".join(["exec", launch.python, *(shlex.quote(a) for a in module)]))
    command = in_container(launch, "; ".join(lines)) if launch.image else "; ".join(lines)
    return JobRequest(command="\n".join([*setup_lines(campaign), command]), job=launch.job,
                      environment=segment.environment,
                      files={CONFIG_FILE: segment.files[CONFIG_FILE]}, result_file=RESULT_FILE)


def reference_preflight_job(campaign: Campaign, layout: Layout, inputs: RunInputs,
                            history: list[dict]) -> JobRequest:
    from operators.campaign.render.reference import CONFIG_FILE, reference_segment

    segment = reference_segment(campaign, layout, inputs, history)
    launch = stage_launch(campaign, "preflight")
    return JobRequest(command=stage_command(campaign, launch, "jobscripts.reference_preflight",
                                            "--config", CONFIG_FILE, "--result", RESULT_FILE),
                      job=launch.job, environment=segment.environment,
                      files={CONFIG_FILE: segment.files[CONFIG_FILE]}, result_file=RESULT_FILE)


def preflight_request(campaign: Campaign, layout: Layout, inputs: RunInputs,
                      history: list[dict]) -> JobRequest:
    """The preflight job of the campaign's path (reference trainer or Bridge)."""
    render = (reference_preflight_job if campaign.model.reference is not None
              else bridge_preflight_job)
    return render(campaign, layout, inputs, history)


class PreflightOperator(ShipsCode, SlurmJobOperator):
    """The campaign's preflight job; fails without retry on a configuration error."""

    def __init__(self, *, campaign: Campaign, **kwargs: Any) -> None:
        kwargs["retries"] = 0  # a configuration error is never retried
        super().__init__(ssh_conn_id=campaign.cluster.ssh_conn_id, result_file=RESULT_FILE,
                         **kwargs)
        self.campaign = campaign
        # Checked here as the run will render it, with stand-ins for what the cluster holds.
        layout = Layout.for_campaign(campaign)
        self.check_request(preflight_request(campaign, layout,
                                             RunInputs.stand_in(campaign, layout), []))

    def prepare_job(self, context: Context) -> JobRequest:
        layout = Layout.for_campaign(self.campaign)
        train_iters = int(context["params"].get("train_iters")
                          or self.campaign.training.train_iters)
        done = read_iteration(self.hook, layout)
        if done >= train_iters:  # nothing will train: a finished campaign's run does nothing
            raise AirflowSkipException(f"campaign done: checkpoint at iteration {done}")
        code_dir = self.ship_code()
        history = read_history(self.hook, layout)
        inputs = RunInputs.of(_data_prefixes(self.hook, layout), layout.tokenizer, code_dir)
        request = preflight_request(self.campaign, layout, inputs, history)
        # The operator's own environment (templated) too, then the shipped code's PYTHONPATH.
        request = replace(request, environment={**request.environment, **self.environment})
        return with_code(request, code_dir)

    def on_job_end(self, context: Context, summary: JobSummary,
                   failure: SlurmJobFailed | None) -> None:
        if failure is None:
            return
        error = (summary.result or {}).get("error")
        if not error:
            return  # no verdict from the job (it died before writing one): retry rules
        raise AirflowFailException(
            f"preflight: this configuration will not run, nothing submitted: {error} "
            f"(check {summary.result.get('failed_check')!r}; Slurm: "
            f"{str(failure).splitlines()[0]})") from failure

"""The CPU reference path's training segment: the trainer's run config and its job. Pure.

The same contracts as the Bridge path (``segment.json``, the checkpoint tracker,
Megatron log lines); ``train_iters`` is the campaign's, fixed, because it sizes
the dataset and the schedule. A segment is cut by ``exit_duration_in_mins``
(and ``exit_interval`` when ``segments.iters_per_segment`` is set), with
``--signal`` as a backup.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from jobscripts.job_files import SEGMENT_RESULT
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs, data_path
from operators.campaign.render.placement import setup_lines
from operators.campaign.render.plan import (
    checkpoint_interval,
    segment_exit_minutes,
    segment_job_options,
)
from operators.campaign.render.stages import stage_job
from operators.slurm.messages import JobRequest
from operators.slurm.operator import python_module_command

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

CONFIG_FILE = "run.json"


def run_config(campaign: Campaign, layout: Layout, data_path: list[str], exit_minutes: float,
               train_iters: int | None = None) -> dict:
    """The reference trainer's config (``jobscripts/trainer_config.py`` keys)."""
    m, t = campaign.model.reference, campaign.training
    v, ck = campaign.validation, campaign.checkpoint
    return {
        "data_path": data_path, "split": campaign.data.split,
        "data_cache_path": layout.data_cache_dir, "tokenizer_model": layout.tokenizer,
        "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_key_value_heads, "seq_length": t.seq_length,
        "train_iters": train_iters or t.train_iters,
        "global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
        "lr": t.lr, "min_lr": t.min_lr, "lr_warmup_iters": t.lr_warmup_iters,
        "lr_decay_iters": t.lr_decay_iters, "lr_decay_style": t.lr_decay_style,
        "weight_decay": t.weight_decay, "clip_grad": t.clip_grad, "seed": t.seed,
        "eval_interval": v.eval_interval, "eval_iters": v.eval_iters,
        "log_interval": campaign.logging.log_interval,
        "save": layout.checkpoints, "save_interval": checkpoint_interval(campaign).iterations,
        "keep_last": ck.keep_last, "keep_every": ck.keep_every,
        "exit_duration_in_mins": exit_minutes,
        "exit_interval": campaign.segments.iters_per_segment,
        "segment_result": SEGMENT_RESULT,
    }


def reference_segment(campaign: Campaign, layout: Layout, inputs: RunInputs, earlier_results=(),
                      train_iters: int | None = None) -> JobRequest:
    """One segment's job (bridge.py's ``bridge_segment`` takes the same arguments)."""
    minutes = segment_exit_minutes(campaign, earlier_results)
    config = run_config(campaign, layout, data_path(campaign, inputs), minutes, train_iters)
    config["save_interval"] = checkpoint_interval(campaign, earlier_results).iterations
    job = {**stage_job(campaign), **segment_job_options(campaign, batch_shell=True)}
    return JobRequest(
        # exec: the trainer becomes the batch shell, so --signal=B:TERM reaches it.
        command="\n".join([*setup_lines(campaign), "exec " + python_module_command(
            "jobscripts.reference_trainer", "--config", CONFIG_FILE)]),
        job=job, environment=dict(campaign.cluster.environment),
        files={CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)},
        result_file=SEGMENT_RESULT)

"""The CPU reference path's training segment: the trainer's run config and its job. Pure.

The same contracts as the Bridge path (``segment.json``, the checkpoint tracker,
Megatron log lines); ``train_iters`` is the campaign's, fixed, because it sizes
the dataset and the schedule. A segment is cut by ``exit_duration_in_mins``
(and ``exit_interval`` when ``segments.iters_per_segment`` is set), with
``--signal`` as a backup.

On one node the trainer is the batch shell itself. On several (``cluster.nodes``) the job has
the production launch shape minus the container and the GPUs: one ``srun`` task per node
starting ``torchrun`` (one process per node, data-parallel over gloo) with the node's rank and
the first node of the allocation as the rendezvous host.
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

from jobscripts.job_files import SEGMENT_RESULT
from operators.campaign.render.bridge import MASTER_PORT
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs, data_path, tokenizer_dir
from operators.campaign.render.placement import setup_lines
from operators.campaign.render.plan import (
    checkpoint_interval,
    segment_exit_minutes,
    segment_job_options,
)
from operators.campaign.render.stages import stage_job
from operators.slurm.messages import JobRequest
from operators.slurm.operator import PYTHON_ENV, python_module_command

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

CONFIG_FILE = "run.json"
TRAINER_MODULE = "jobscripts.reference_trainer"
# The rendezvous host by address, not name: a node's name may resolve only on the node
# itself (the local cluster's nodes bind their hosts file in their own namespace), and
# Slurm's NodeAddr is what slurmctld itself reaches the node by. sed, not head: head exits
# early, scontrol dies of SIGPIPE, and pipefail + set -e end the job.
MASTER_ADDR_LINES = (
    'MASTER_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
    'MASTER_ADDR="$(scontrol show node "$MASTER_NODE"'
    + r""" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')""" + '"',
    "export MASTER_ADDR",
)


def run_config(campaign: Campaign, layout: Layout, inputs: RunInputs, exit_minutes: float,
               train_iters: int | None = None) -> dict:
    """The reference trainer's config (``jobscripts/trainer_config.py`` keys). Data and
    tokenizer as the Bridge path takes them (paths.py): a campaign's own
    ``data.tokenizer.path`` is loaded from there."""
    m, t = campaign.model.reference, campaign.training
    v, ck = campaign.validation, campaign.checkpoint
    return {
        "data_path": data_path(campaign, inputs), "split": campaign.data.split,
        "data_cache_path": layout.data_cache_dir,
        # The data stage saves a trained tokenizer there (Layout), whoever renders this.
        "tokenizer_model": tokenizer_dir(campaign, inputs, default=layout.tokenizer),
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


def distributed_launch(campaign: Campaign, master_port: int = MASTER_PORT) -> str:
    """The ``srun`` line: per node, ``torchrun`` starts one trainer process. SLURM_NODEID
    and SLURM_NNODES differ per node/job, so the inner shell expands them on the node."""
    torchrun = [f'"${PYTHON_ENV}"', "-m", "torch.distributed.run",
                "--nnodes", '"$SLURM_NNODES"', "--nproc-per-node", "1",
                "--node-rank", '"$SLURM_NODEID"', "--master-addr", '"$MASTER_ADDR"',
                "--master-port", str(master_port),
                "-m", TRAINER_MODULE, "--config", CONFIG_FILE]
    srun = ["srun", "--ntasks-per-node=1",
            # One node's crash ends the step at once instead of leaving the others blocked
            # in a collective until the distributed timeout.
            "--kill-on-bad-exit=1"]
    if campaign.cluster.cpus_per_task is not None:
        srun.append('--cpus-per-task="$SLURM_CPUS_PER_TASK"')  # see bridge.py: 22.05-23.02
    return " ".join([*srun, "bash", "-c", shlex.quote("exec " + " ".join(torchrun))])


def reference_segment(campaign: Campaign, layout: Layout, inputs: RunInputs, earlier_results=(),
                      train_iters: int | None = None) -> JobRequest:
    """One segment's job (bridge.py's ``bridge_segment`` takes the same arguments)."""
    minutes = segment_exit_minutes(campaign, earlier_results)
    config = run_config(campaign, layout, inputs, minutes, train_iters)
    config["save_interval"] = checkpoint_interval(campaign, earlier_results).iterations
    nodes = campaign.cluster.nodes
    job = {**stage_job(campaign), **segment_job_options(campaign, batch_shell=nodes == 1)}
    if nodes == 1:
        # exec: the trainer becomes the batch shell, so --signal=B:TERM reaches it.
        lines = ["exec " + python_module_command(TRAINER_MODULE, "--config", CONFIG_FILE)]
    else:
        # --signal without B: reaches the srun tasks; torchrun forwards it to the trainer.
        job.update(nodes=nodes, ntasks_per_node=1)
        lines = [*MASTER_ADDR_LINES, distributed_launch(campaign)]
    return JobRequest(
        command="\n".join([*setup_lines(campaign), *lines]),
        job=job, environment=dict(campaign.cluster.environment),
        files={CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)},
        result_file=SEGMENT_RESULT)

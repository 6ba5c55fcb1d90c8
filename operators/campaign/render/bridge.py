"""The production path: a campaign -> Megatron Bridge override YAML + the sbatch job that
runs it, as the reference workflow does by hand (docs/campaign.md). Pure: no SSH, no Bridge.

The job: one task per node (``srun --mpi=pmi2``) starts ``apptainer run --nv`` on the NeMo
image, which starts ``torchrun`` with the node's GPUs; torchrun runs our entrypoint
``jobscripts.bridge_pretrain`` (recipe by name, our YAML checked key by key, then Bridge's
``pretrain``). The YAML overrides the recipe; CLI overrides would override the YAML.

Facts this relies on (Bridge 26.04-alpha.rc2):
- FP8 is ``mixed_precision: bf16_with_fp8_current_scaling_mixed``, never ``model.fp8``.
- The recipe's scheduler carries its own weight decay (start/end 0.033) that overrides
  ``optimizer.weight_decay``; both are set here so the campaign's value is the one used.
- ``train.exit_duration_in_mins`` saves and exits; the signal handler does not (before
  v0.6.0), so ``--signal`` is only a backup.
- Its MLflow logger would upload every checkpoint: tracking stays outside (operators/tracking).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

import yaml

from jobscripts.bridge_result import JOB_START_ENV
from jobscripts.job_files import SEGMENT_RESULT
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs, tokenizer_dir
from operators.campaign.render.placement import container_argv, export_lines, setup_lines
from operators.campaign.render.plan import (
    checkpoint_interval,
    exit_duration_minutes,
    segment_exit_minutes,
    segment_job_options,
)
from operators.slurm.messages import JobRequest

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

__all__ = ["CONFIG_FILE", "MIXED_PRECISION", "SEGMENT_RESULT", "bridge_job", "bridge_overrides",
           "bridge_segment", "exit_duration_minutes", "render_bridge_yaml"]

CONFIG_FILE = "bridge.yaml"  # uploaded into the job's run directory (its working directory)
MASTER_PORT = 29500
MIXED_PRECISION = {"bf16": "bf16_mixed", "fp8": "bf16_with_fp8_current_scaling_mixed"}
_RECOMPUTE = {
    "none": {"recompute_granularity": None},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1},
}
# Set inside the training container; cluster.environment or container.environment may
# override them.
BASE_ENVIRONMENT = {
    # Megatron's TP/SP communication overlap needs kernels queued in order.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # Compute nodes usually cannot reach the Hub; the recipe's HF config and the tokenizer
    # then come from HF_HOME / local paths, and a missing one fails at once, not after a timeout.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def blend_data_path(blend) -> list[str]:
    """A blend as Megatron's ``data_path`` list: weight, prefix, weight, prefix, ...
    (``get_blend_from_list`` reads the weights back from these strings)."""
    return [item for b in blend for item in (repr(float(b.weight)), b.prefix)]


def _data_path(campaign: Campaign, inputs: RunInputs) -> list[str]:
    """Megatron's ``--data-path`` list: prefixes, or weight, prefix, weight, prefix, ..."""
    data = campaign.data
    if data.blend is not None:
        return blend_data_path(data.blend)
    if data.prefixes is not None:
        return list(data.prefixes)
    if not inputs.data_prefixes:
        raise ValueError("data comes from the data stage's manifest: pass "
                         "RunInputs(data_prefixes=...) read from it")
    return list(inputs.data_prefixes)


def bridge_overrides(campaign: Campaign, layout: Layout, inputs: RunInputs,
                     exit_duration_in_mins: int, train_iters: int | None = None,
                     earlier_results=()) -> dict:
    """The override tree, section by section, in Bridge's ConfigContainer field names.
    ``train_iters``: the trigger form's, else the campaign's."""
    if campaign.model.recipe is None:
        raise ValueError("model.recipe: the Bridge path needs a recipe (the reference model "
                         "runs on jobscripts.reference_trainer)")
    if isinstance(exit_duration_in_mins, bool) or not isinstance(exit_duration_in_mins, int) \
            or exit_duration_in_mins < 1:
        raise ValueError(f"exit_duration_in_mins must be a positive int "
                         f"(got {exit_duration_in_mins!r})")
    t, v = campaign.training, campaign.validation
    train_iters = train_iters or t.train_iters
    train = {"train_iters": train_iters, "global_batch_size": t.global_batch_size,
             "micro_batch_size": t.micro_batch_size,
             "exit_duration_in_mins": exit_duration_in_mins,
             "exit_signal_handler": True}  # a no-op at rc2; saves on --signal from v0.6.0
    if campaign.segments.iters_per_segment is not None:
        train["exit_interval"] = campaign.segments.iters_per_segment
    scheduler = {"lr_warmup_iters": t.lr_warmup_iters,
                 "lr_decay_iters": t.lr_decay_iters or train_iters,
                 "lr_decay_style": t.lr_decay_style,
                 "start_weight_decay": t.weight_decay, "end_weight_decay": t.weight_decay,
                 "weight_decay_incr_style": "constant"}
    if t.lr_wsd_decay_iters is not None:
        scheduler["lr_wsd_decay_iters"] = t.lr_wsd_decay_iters
    return {
        "dataset": {"data_path": _data_path(campaign, inputs), "split": campaign.data.split,
                    "sequence_length": t.seq_length, "random_seed": t.seed,
                    "path_to_cache": layout.data_cache_dir},
        "train": train,
        "validation": {"eval_interval": v.eval_interval, "eval_iters": v.eval_iters},
        "optimizer": {"lr": t.lr, "min_lr": t.min_lr, "weight_decay": t.weight_decay,
                      "clip_grad": t.clip_grad},
        "scheduler": scheduler,
        # The resume contract: one directory per campaign, saves in sync (segment.json times
        # them; exit_duration assumes it), format and optimizer layout pinned, not inherited
        # from whatever recipe version the container has.
        "checkpoint": {"save": layout.checkpoint_dir, "load": layout.checkpoint_dir,
                       "save_interval": checkpoint_interval(campaign, earlier_results).iterations,
                       "ckpt_format": "torch_dist",
                       "async_save": False,
                       # Bridge keeps every save; ours prune after each one (keep_last and
                       # keep_every, jobscripts/bridge_pretrain.py --keep-last/--keep-every).
                       "most_recent_k": -1},
        "ddp": {"use_distributed_optimizer": True, "check_for_nan_in_grad": True},
        "model": {"seq_length": t.seq_length,
                  "tensor_model_parallel_size": t.tensor_parallel_size,
                  "pipeline_model_parallel_size": t.pipeline_parallel_size,
                  "context_parallel_size": t.context_parallel_size,
                  "sequence_parallel": t.tensor_parallel_size > 1,
                  **_RECOMPUTE[t.recompute]},
        "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer",
                      "tokenizer_model": tokenizer_dir(campaign, inputs),
                      "vocab_size": None},  # the recipe's NullTokenizer size, unused now
        "logger": {"log_interval": campaign.logging.log_interval,
                   "tensorboard_dir": layout.tensorboard_dir},
        "rng": {"seed": t.seed},
        "mixed_precision": MIXED_PRECISION[t.precision],
    }


def render_bridge_yaml(campaign: Campaign, layout: Layout, inputs: RunInputs,
                       exit_duration_in_mins: int, train_iters: int | None = None,
                       earlier_results=()) -> str:
    tree = bridge_overrides(campaign, layout, inputs, exit_duration_in_mins, train_iters,
                            earlier_results)
    header = (f"# Megatron Bridge overrides for campaign {campaign.name}, recipe "
              f"{campaign.model.recipe} ({campaign.model.recipe_function}).\n"
              "# Rendered by operators/campaign/render/bridge.py; "
              "precedence CLI > this file > recipe.\n")
    return header + yaml.safe_dump(tree, sort_keys=False, default_flow_style=False, width=100)


def _inner_command(campaign: Campaign, inputs: RunInputs, master_port: int, config_file: str,
                   segment_result: str) -> str:
    """What runs inside the container on each node. SLURM_NODEID and friends differ per
    node, so they are expanded there, by this inner shell, not by the batch script."""
    gpus = campaign.cluster.gpus_per_node
    torchrun = ["torchrun", "--nnodes", '"$SLURM_NNODES"', "--nproc-per-node", str(gpus),
                "--node-rank", '"$SLURM_NODEID"', "--master-addr", '"$MASTER_ADDR"',
                "--master-port", str(master_port),
                "-m", "jobscripts.bridge_pretrain", "--recipe", shlex.quote(campaign.model.recipe),
                "--config-file", shlex.quote(config_file),
                "--segment-result", shlex.quote(segment_result)]
    k = campaign.checkpoint
    torchrun += ["--keep-last", str(k.keep_last)]
    if k.keep_every is not None:
        torchrun += ["--keep-every", str(k.keep_every)]
    # The container's own environment, exported in here (after any entrypoint): host jobs
    # never see it. Defaults give way to what either environment of the campaign sets.
    container = campaign.cluster.container
    environment = {key: value for key, value in BASE_ENVIRONMENT.items()
                   if key not in campaign.cluster.environment}
    lines = export_lines({**environment, **container.environment})
    if inputs.code_dir is not None:
        # Set in here: the image's own PYTHONPATH would win over one passed from the host.
        code = shlex.quote(inputs.code_dir)
        lines.append(f"export PYTHONPATH={code}${{PYTHONPATH:+:$PYTHONPATH}}")
    lines.append("exec " + " ".join(torchrun))
    return "; ".join(lines)


def bridge_job(campaign: Campaign, inputs: RunInputs, *, master_port: int = MASTER_PORT,
               config_file: str = CONFIG_FILE,
               segment_result: str = SEGMENT_RESULT) -> tuple[dict, str, dict]:
    """``(job options, command, environment)`` for ``SlurmJobOperator`` / ``build_spec``.

    The container is started inside ``srun`` (one per node), so the spec's own container
    prefix (``apptainer exec`` around the whole script) is not used.
    """
    c = campaign.cluster
    if c.container is None or campaign.model.recipe is None:
        raise ValueError("the Bridge job needs model.recipe and cluster.container")
    if not 1024 <= master_port <= 65535:
        raise ValueError(f"master_port must be in 1024-65535 (got {master_port})")
    job = {"nodes": c.nodes, "ntasks_per_node": 1, "gpus_per_node": str(c.gpus_per_node),
           "time": c.time_limit, "exclusive": c.exclusive,
           **segment_job_options(campaign, batch_shell=False)}
    job.update({name: getattr(c, name) for name in ("partition", "account", "qos",
                                                    "cpus_per_task", "mem")
                if getattr(c, name) is not None})
    container = container_argv(c.container.image, c.container.binds, c.container.entrypoint,
                               verb="run")
    inner = _inner_command(campaign, inputs, master_port, config_file, segment_result)
    srun = ["srun", "--mpi=pmi2", "--ntasks-per-node=1",
            # --kill-on-bad-exit: one node's crash ends the step instead of hanging the others.
            "--kill-on-bad-exit=1"]
    if c.cpus_per_task is not None:
        # srun of Slurm 22.05-23.02 ignores SLURM_CPUS_PER_TASK: without this the step
        # gets one CPU per task, and torchrun's workers and data loaders share it.
        srun.append('--cpus-per-task="$SLURM_CPUS_PER_TASK"')
    command = "\n".join([
        # When the job started: Bridge's exit timer starts inside pretrain(), so the time
        # before it (container, imports, recipe) is measured from here (startup_seconds).
        f'{JOB_START_ENV}="$(date +%s)"', f"export {JOB_START_ENV}",
        *setup_lines(campaign),
        # torchrun's rendezvous host: the first node of the allocation. sed, not head:
        # head exits early, scontrol dies of SIGPIPE, and pipefail + set -e end the job.
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        "export MASTER_ADDR",
        " ".join([*srun, container, "bash", "-c", shlex.quote(inner)]),
    ])
    return job, command, dict(c.environment)


def bridge_segment(campaign: Campaign, layout: Layout, inputs: RunInputs, earlier_results=(),
                   train_iters: int | None = None) -> JobRequest:
    """One segment's job: job options, command, environment and the rendered YAML as an
    uploaded file. ``earlier_results``: earlier segment.json payloads, whose measured start-up
    and save times set this segment's training budget; ``train_iters``: the trigger form's,
    else the campaign's. (reference.py's ``reference_segment`` takes the same arguments.)"""
    minutes = segment_exit_minutes(campaign, earlier_results)
    job, command, environment = bridge_job(campaign, inputs)
    yaml_text = render_bridge_yaml(campaign, layout, inputs, minutes, train_iters,
                                   earlier_results)
    return JobRequest(command=command, job=job, environment=environment,
                      files={CONFIG_FILE: yaml_text}, result_file=SEGMENT_RESULT)

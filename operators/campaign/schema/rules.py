"""Rules that need more than one field of a campaign, and the recipe facts they use.

Each rule returns messages that start with the dotted path of the field a user should
change. Duck-typed over the :class:`~operators.campaign.schema.config.Campaign` model so that this
module imports nothing from the schema (which calls it from its validator).
"""

from __future__ import annotations

import posixpath
from typing import NamedTuple

from operators.slurm.spec import ContainerSpec, JobSpec, JobSpecError


class RecipeInfo(NamedTuple):
    params: float  # parameter count, for the summary's tokens-per-parameter
    max_seq_length: int  # the positions the model's RoPE setup is made for
    # The HF model whose config.json the recipe builds from (AutoBridge.from_hf_pretrained
    # in the recipe): export needs the same one, from HF_HOME (jobscripts/export_hf.py).
    hf_model: str


# Bridge recipes whose sizes we know; any other recipe name is allowed, just not summarised.
KNOWN_RECIPES = {
    "llama32_1b": RecipeInfo(1.24e9, 131072, "meta-llama/Llama-3.2-1B"),
    "llama32_3b": RecipeInfo(3.21e9, 131072, "meta-llama/Llama-3.2-3B"),
    "llama3_8b": RecipeInfo(8.03e9, 8192, "meta-llama/Meta-Llama-3-8B"),
    "llama31_8b": RecipeInfo(8.03e9, 131072, "meta-llama/Meta-Llama-3.1-8B"),
    "llama3_70b": RecipeInfo(70.6e9, 8192, "meta-llama/Meta-Llama-3-70B"),
    "llama31_70b": RecipeInfo(70.6e9, 131072, "meta-llama/Meta-Llama-3.1-70B"),
    "llama31_405b": RecipeInfo(405.9e9, 131072, "meta-llama/Meta-Llama-3.1-405B"),
}


Problem = tuple[str, str]  # (dotted field path, message)


def cross_field_problems(c) -> list[Problem]:
    return [*_parallelism(c), *_schedule(c), *_paths(c), *_segments(c), *_job_limits(c)]


def _parallelism(c):
    t = c.training
    known = KNOWN_RECIPES.get(c.model.recipe or "")
    if known and t.seq_length > known.max_seq_length:
        yield "training.seq_length", (f"{t.seq_length} exceeds {c.model.recipe}'s "
                                      f"{known.max_seq_length}")
    if c.model.recipe is not None and c.cluster.gpus_per_node < 1:
        yield "cluster.gpus_per_node", "a Bridge recipe trains on GPUs (at least 1)"
    if c.model.reference is not None and t.model_parallel_size != 1:
        yield "training.tensor_parallel_size", ("the reference trainer runs unsplit: tensor, "
                                                "pipeline and context parallel sizes must be 1")
        return
    world, mp = c.world_size, t.model_parallel_size
    if world < 1 or world % mp:
        yield "training.tensor_parallel_size", (f"TP x PP x CP = {mp} must divide the world "
                                                f"size (nodes x gpus_per_node = {world})")
        return
    per_step = t.micro_batch_size * (world // mp)
    if t.global_batch_size % per_step:
        yield "training.global_batch_size", (
            f"{t.global_batch_size} is not a multiple of micro_batch_size x data-parallel size "
            f"= {t.micro_batch_size} x {world // mp} = {per_step}")


def _schedule(c):
    t = c.training
    if t.min_lr > t.lr:
        yield "training.min_lr", f"{t.min_lr} exceeds lr {t.lr}"
    if t.lr_warmup_iters >= t.train_iters:
        yield "training.lr_warmup_iters", (f"{t.lr_warmup_iters} must be below train_iters "
                                           f"{t.train_iters}")
    if t.lr_decay_iters is not None and t.lr_decay_iters <= t.lr_warmup_iters:
        yield "training.lr_decay_iters", "must exceed lr_warmup_iters"
    if (t.lr_decay_style == "WSD") != (t.lr_wsd_decay_iters is not None):
        yield "training.lr_wsd_decay_iters", "set it exactly when lr_decay_style is WSD"
    if c.model.reference is None:
        return
    if t.lr_decay_style == "WSD":
        yield "training.lr_decay_style", "the reference trainer supports cosine, linear, constant"
    if t.precision == "fp8":
        yield "training.precision", ("fp8 needs GPUs (a Bridge recipe); the reference trainer "
                                     "runs in fp32 on CPU")
    if t.recompute != "none":
        yield "training.recompute", "the reference trainer does not recompute"


def recipe_hf_model(c) -> str | None:
    """The HF model id a Bridge campaign's recipe is built from: ``model.hf_model``, else
    the known recipe's; None for the reference model or an unknown recipe without one."""
    if c.model.recipe is None:
        return None
    known = KNOWN_RECIPES.get(c.model.recipe)
    return c.model.hf_model or (known.hf_model if known else None)


def _paths(c):
    if c.model.recipe is not None and c.cluster.container is None:
        yield "cluster.container", "a Bridge recipe runs inside the NeMo container: set it"
    if c.model.recipe is not None and recipe_hf_model(c) is None:
        yield "model.hf_model", (f"recipe {c.model.recipe!r} is not one this project knows: "
                                 "name the Hugging Face model id it is built from (export "
                                 "reads that model's config.json from HF_HOME)")
    if c.model.recipe is not None and c.cluster.container is not None \
            and c.stages.evaluate.image is None:
        yield "stages.evaluate.image", ("a Bridge campaign evaluates with vLLM on a GPU: name "
                                        "an image with vLLM (or 'host' for the cluster's Python)")
    if c.checkpoint.dir is None and c.cluster.remote_root is None:
        yield "cluster.remote_root", "needed unless checkpoint.dir is set"
    if c.checkpoint.dir is not None and c.cluster.remote_root is None \
            and posixpath.dirname(c.checkpoint.dir.rstrip("/")) in ("", "/"):
        yield "checkpoint.dir", ("without cluster.remote_root the campaign's files go beside "
                                 "the checkpoints: it needs a parent below '/'")
    k = c.checkpoint
    if k.keep_every is not None and k.save_interval != "auto" and k.keep_every % k.save_interval:
        yield "checkpoint.keep_every", (f"{k.keep_every} is not a multiple of save_interval "
                                        f"{k.save_interval}, so few saves would land on it")


def _segments(c):
    s, limit = c.segments, c.cluster.time_limit_minutes
    if limit - s.startup_estimate_min - s.save_estimate_s / 60 - s.margin_min < 1:
        yield "cluster.time_limit", (f"{limit} min leaves no training time after "
                                     "segments.startup_estimate_min + save_estimate_s + margin_min")


# Beyond any node built: a larger request can never start, and Slurm says so only at sbatch.
MAX_CPUS_PER_TASK = 1024
MAX_GPUS_PER_NODE = 64
MAX_NODES = 10_000
# Slurm's default MaxArraySize is 1001 (indices 0-1000): a larger array is refused at sbatch.
MAX_ARRAY_TASKS = 1000
MAX_RETRIES = 100
MAX_RETRY_DELAY_S = 86_400  # Airflow's backoff grows from it; a timedelta overflows past 10**14

# JobSpec field -> the campaign field it is made from, for the parse-time check below.
_SPEC_FIELDS = {"partition": "cluster.partition", "account": "cluster.account",
                "qos": "cluster.qos", "time": "cluster.time_limit", "mem": "cluster.mem",
                "nodes": "cluster.nodes", "gpus_per_node": "cluster.gpus_per_node",
                "cpus_per_task": "cluster.cpus_per_task", "environment": "cluster.environment",
                "container.image": "cluster.container.image"}


def _job_limits(c):
    problems = list(_limits(c))
    # The spec check repeats a limit's problem in the spec's words: one message per field.
    return problems or list(_job_spec(c))


def _limits(c):
    cl = c.cluster
    for name, value, cap in (("cluster.cpus_per_task", cl.cpus_per_task, MAX_CPUS_PER_TASK),
                             ("data.tokenize_workers", c.data.tokenize_workers,
                              MAX_CPUS_PER_TASK),
                             ("cluster.gpus_per_node", cl.gpus_per_node, MAX_GPUS_PER_NODE),
                             ("cluster.nodes", cl.nodes, MAX_NODES)):
        if value is not None and value > cap:
            yield name, f"{value} is more than any node has (at most {cap})"
    if c.data.array_tasks > MAX_ARRAY_TASKS:
        yield "data.array_tasks", (f"{c.data.array_tasks} tasks is more than Slurm's default "
                                   f"MaxArraySize allows (at most {MAX_ARRAY_TASKS})")
    for stage, placement in c.stages:  # each stage's own placement, where it sets one
        for field, cap in (("cpus_per_task", MAX_CPUS_PER_TASK),
                           ("gpus_per_node", MAX_GPUS_PER_NODE)):
            value = getattr(placement, field)
            if value is not None and value > cap:
                yield f"stages.{stage}.{field}", (f"{value} is more than any node has "
                                                  f"(at most {cap})")
    for stage in ("data", "train", "export"):
        retry = getattr(c.retries, stage)
        if retry.retries > MAX_RETRIES:
            yield f"retries.{stage}.retries", f"at most {MAX_RETRIES}"
        if retry.retry_delay > MAX_RETRY_DELAY_S:
            yield f"retries.{stage}.retry_delay", f"at most {MAX_RETRY_DELAY_S} s (a day)"


def _job_spec(c):
    """The job spec every job of the campaign starts from, validated now: what would fail
    when a task renders its script fails at DAG parse instead, naming the campaign field."""
    cl = c.cluster
    container = None
    if cl.container is not None:
        container = ContainerSpec(image=cl.container.image, binds=tuple(cl.container.binds))
    try:
        JobSpec(name="pp-parse-check", command="true", output="/parse-check/slurm-%j.out",
                partition=cl.partition, account=cl.account, qos=cl.qos, nodes=cl.nodes,
                gpus_per_node=str(cl.gpus_per_node) if cl.gpus_per_node else None,
                cpus_per_task=cl.cpus_per_task, mem=cl.mem, time=cl.time_limit,
                environment=dict(cl.environment), container=container).validate()
    except JobSpecError as exc:
        name = exc.field_name
        field = _SPEC_FIELDS.get(name) or ("cluster.container.binds" + name.removeprefix(
            "container.binds") if name.startswith("container.binds") else f"cluster ({name})")
        yield field, str(exc).removeprefix(f"job spec field {name!r}: ")

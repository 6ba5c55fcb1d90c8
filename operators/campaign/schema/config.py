"""The typed campaign schema: one YAML per campaign under ``dags/campaigns/``.

Every section forbids unknown keys (a misspelt ``lr_warmup_iter`` silently ignored would
train the wrong run for days, which is what Bridge does with its YAML). Field checks live in
:mod:`operators.campaign.schema.fields`; the checks that need more than one field are in
:mod:`operators.campaign.schema.rules`, each naming the field a user has to change.
Loading and error formatting: :mod:`operators.campaign.schema.load`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from operators.campaign.schema.fields import (
    AbsPath,
    Bind,
    Command,
    ConnId,
    Environment,
    Image,
    Memory,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    SafePath,
    Schedule,
    Share,
    Slug,
    SlurmName,
    SlurmTime,
    Source,
    Text,
    slurm_minutes,
)
from operators.campaign.schema.health import Health
from operators.campaign.schema.rules import cross_field_problems

HfModelId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/"
                                          r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")]
ExperimentName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._/-]{0,127}$")]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _exactly_one(section: BaseModel, *names: str) -> None:
    given = [n for n in names if getattr(section, n) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(names)} "
                         f"(got {', '.join(given) or 'none'})")


# --- cluster ------------------------------------------------------------------------------
# Bounds on what one file may ask for: a list or task count past these is a mistake, and
# unbounded ones cost the DAG processor seconds and memory at every parse (issue: unbounded work).
MAX_LIST = 256  # binds, set-up lines
MAX_PREFIXES = 4096  # data prefixes or blend entries
MAX_SEGMENTS_PER_RUN = 1000  # segment tasks one DAG run holds
MAX_PREQUEUE_DEPTH = 8  # segment jobs queued ahead of the running one (docs/prequeue.md)


class Container(Section):
    image: Image  # a .sif file on the cluster, or docker://nvcr.io/nvidia/nemo:<tag>
    # /host[:/container[:ro]], one --bind each
    binds: list[Bind] = Field(default=[], max_length=MAX_LIST)
    # A site wrapper the command runs under inside the container (NCCL over the fast network,
    # CUDA forward compatibility), e.g. /host/adapt.sh: plain words, each quoted.
    entrypoint: Command | None = None
    # Exported inside containers only: paths that exist there (HF_HOME=/hf_home). Host jobs
    # (ingest, gates, tokenization) never see them.
    environment: Environment = {}


class Placement(Section):
    """Where one non-training stage runs; an unset field takes the stage's default
    (operators/campaign/render/placement.py)."""

    image: Image | None = None  # 'host': no container; default per stage
    partition: SlurmName | None = None
    gpus_per_node: NonNegInt | None = None
    cpus_per_task: PosInt | None = None
    mem: Memory | None = None
    time_limit: SlurmTime | None = None


class Stages(Section):
    data: Placement = Placement()  # every data-stage job: small CPU jobs on the host
    preflight: Placement = Placement()  # the training image, no GPU
    export: Placement = Placement()  # the training image, on CPU
    evaluate: Placement = Placement()  # a vLLM image on one GPU (Bridge campaigns)


class Cluster(Section):
    ssh_conn_id: ConnId
    partition: SlurmName | None = None
    account: SlurmName | None = None
    qos: SlurmName | None = None
    nodes: PosInt = 1
    gpus_per_node: NonNegInt = 0  # 0: the CPU reference path
    cpus_per_task: PosInt | None = None
    mem: Memory | None = None
    time_limit: SlurmTime  # per segment job; segments chain past it
    exclusive: bool = False
    # Site set-up run before every job's command (``module load brics/nccl``): plain words.
    setup: list[Command] = Field(default=[], max_length=MAX_LIST)
    container: Container | None = None  # None: run in the host's environment
    environment: Environment = {}  # exported in every job; see fields.env_key
    remote_root: AbsPath | None = None  # campaign dirs live under <remote_root>/<name>/

    @property
    def time_limit_minutes(self) -> int:
        return slurm_minutes(self.time_limit)


# --- data ---------------------------------------------------------------------------------
class BlendItem(Section):
    weight: PosFloat
    # Megatron prefix: <prefix>.bin / <prefix>.idx. Absolute: a relative one would resolve
    # against each job's own run directory, never where the data is.
    prefix: AbsPath


class Gate(Section):
    """Data-quality gate on a sample of the ingested documents; any breach stops the run."""

    sample_size: PosInt = 1000
    max_duplicate_rate: Share = 0.05
    max_replacement_char_share: Share = 0.001  # U+FFFD: text that was not valid UTF-8
    max_nonprintable_share: Share = 0.001


class TrainTokenizer(Section):
    vocab_size: PosInt


class Tokenizer(Section):
    path: SafePath | None = None  # a directory holding tokenizer.json (HF format)
    train: TrainTokenizer | None = None  # or: train a byte-level BPE on the corpus

    @model_validator(mode="after")
    def _one(self):
        _exactly_one(self, "path", "train")
        return self


class Data(Section):
    # Where the tokens come from: raw documents the data stage ingests and tokenizes, or an
    # already-tokenized dataset (its manifest.json, Megatron prefixes, or a weighted blend).
    source: Source | None = None  # 'demo', s3://..., hf://..., or a Parquet path/glob
    manifest: SafePath | None = None
    prefixes: list[AbsPath] | None = Field(default=None, min_length=1, max_length=MAX_PREFIXES)
    blend: list[BlendItem] | None = Field(default=None, min_length=1, max_length=MAX_PREFIXES)
    split: Annotated[str, Field(pattern=r"^[0-9]+,[0-9]+,[0-9]+$")] = "969,30,1"
    min_doc_chars: PosInt = 200
    max_doc_chars: PosInt = 100_000
    dedup: bool = True
    gate: Gate = Gate()
    tokenizer: Tokenizer
    tokenize_workers: PosInt = 1
    # Ingest and tokenization as Slurm job arrays of this many tasks (each a group of input
    # shards, spread over the nodes), then one merge job; 1: one job each.
    array_tasks: PosInt = 1

    @model_validator(mode="after")
    def _checks(self):
        _exactly_one(self, "source", "manifest", "prefixes", "blend")
        if self.min_doc_chars >= self.max_doc_chars:
            raise ValueError("data.min_doc_chars must be below data.max_doc_chars")
        if int(self.split.split(",")[0]) == 0:
            raise ValueError("data.split: the train weight (first number) must be above 0")
        return self


# --- model --------------------------------------------------------------------------------
class ReferenceModel(Section):
    """The tiny Llama the CPU reference trainer builds (transformers LlamaForCausalLM)."""

    hidden_size: PosInt
    num_layers: PosInt
    num_attention_heads: PosInt
    num_key_value_heads: PosInt
    ffn_hidden_size: PosInt

    @model_validator(mode="after")
    def _shapes(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model.reference.hidden_size must be a multiple of "
                             "num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model.reference.num_attention_heads must be a multiple of "
                             "num_key_value_heads")
        return self


class Model(Section):
    # A Megatron Bridge recipe, e.g. llama31_8b -> llama31_8b_pretrain_config()
    recipe: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")] | None = None
    reference: ReferenceModel | None = None
    # The HF model the recipe builds its config from; known recipes have theirs
    # (rules.KNOWN_RECIPES). Export reads its config.json from HF_HOME.
    hf_model: HfModelId | None = None

    @model_validator(mode="after")
    def _one(self):
        _exactly_one(self, "recipe", "reference")
        if self.hf_model is not None and self.recipe is None:
            raise ValueError("model.hf_model goes with model.recipe")
        return self

    @property
    def recipe_function(self) -> str | None:
        return f"{self.recipe}_pretrain_config" if self.recipe else None


# --- training and the rest -------------------------------------------------------------------
class Training(Section):
    train_iters: PosInt  # fixed for the whole campaign: it sizes the dataset and the schedule
    global_batch_size: PosInt
    micro_batch_size: PosInt
    seq_length: PosInt
    lr: PosFloat
    min_lr: NonNegFloat = 0.0
    lr_warmup_iters: NonNegInt = 0
    lr_decay_style: Literal["cosine", "linear", "constant", "WSD"] = "cosine"
    lr_decay_iters: PosInt | None = None  # None: train_iters
    lr_wsd_decay_iters: PosInt | None = None  # the decay phase of WSD
    weight_decay: NonNegFloat = 0.1
    clip_grad: NonNegFloat = 1.0  # 0 disables clipping
    precision: Literal["bf16", "fp8"] = "bf16"  # fp8: bf16 with FP8 current scaling
    tensor_parallel_size: PosInt = 1
    pipeline_parallel_size: PosInt = 1
    context_parallel_size: PosInt = 1
    recompute: Literal["none", "selective", "full"] = "none"
    seed: NonNegInt = 1234

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size


def _count_or_auto(value, handler):
    # "auto" or a positive int, with one error at the field itself (a plain union reports a
    # branch per type: "save_interval.constrained-int", "save_interval.literal['auto']").
    if value == "auto":
        return value
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("count_or_auto", "a positive number of iterations or 'auto' "
                                  "(got {value})", {"value": repr(value)}) from None


def _minutes_or_auto(value, handler):
    # "auto" or a positive number of minutes, with one error at the field (see above).
    if value == "auto":
        return value
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("minutes_or_auto", "a positive number of minutes or 'auto' "
                                  "(got {value})", {"value": repr(value)}) from None


class Checkpoint(Section):
    # Iterations between saves, or "auto": the Young/Daly interval from the measured save time
    # and the failures seen (render/plan.py checkpoint_interval), bounded by the segment length.
    save_interval: Annotated[PosInt, WrapValidator(_count_or_auto)]
    keep_last: PosInt = 2  # the resume point always survives: at least 1
    keep_every: PosInt | None = None  # also keep every Mth iteration, for evaluation
    dir: AbsPath | None = None  # default <remote_root>/<name>/checkpoints


class Validation(Section):
    eval_interval: PosInt | None = None  # None: no validation
    eval_iters: PosInt = 10


class Logging(Section):
    log_interval: PosInt = 10


class Tracking(Section):
    enabled: bool = True
    mlflow_conn_id: ConnId = "mlflow_default"
    experiment: ExperimentName | None = None  # default: the campaign name


class Retry(Section):
    retries: NonNegInt
    retry_delay: PosInt  # seconds
    exponential_backoff: bool = True


class Retries(Section):
    data: Retry = Retry(retries=2, retry_delay=60)
    train: Retry = Retry(retries=3, retry_delay=300)
    export: Retry = Retry(retries=1, retry_delay=60)


class Segments(Section):
    # segment tasks one DAG run creates; surplus ones skip when done
    max_per_run: Annotated[PosInt, Field(le=MAX_SEGMENTS_PER_RUN)] = 4
    iters_per_segment: PosInt | None = None  # also cut at iteration multiples (exit_interval)
    # A running segment whose log shows no progress this long is stopped and retried; "auto":
    # from its measured step time (tracking/hang.py, docs/log-watch.md).
    hang_timeout_min: Annotated[PosFloat | Literal["auto"],
                                WrapValidator(_minutes_or_auto)] = "auto"
    # Job start -> the trainer's exit timer (container, imports, recipe; Bridge starts its
    # timer inside pretrain()), until a segment has measured it (startup_seconds).
    startup_estimate_min: NonNegFloat = 10.0
    save_estimate_s: NonNegFloat = 120.0  # a save, until an earlier segment has measured one
    margin_min: Annotated[float, Field(ge=2)] = 5.0  # slack before the hard limit
    # Segment jobs queued behind the running one (afterok), so the chain goes on while
    # Airflow is down; 0: each segment is submitted after the one before ended.
    prequeue_depth: Annotated[NonNegInt, Field(le=MAX_PREQUEUE_DEPTH)] = 1


class Campaign(Section):
    name: Slug
    description: Text = ""
    schedule: Schedule = None
    cluster: Cluster
    data: Data
    model: Model
    training: Training
    checkpoint: Checkpoint
    validation: Validation = Validation()
    logging: Logging = Logging()
    tracking: Tracking = Tracking()
    retries: Retries = Retries()
    segments: Segments = Segments()
    stages: Stages = Stages()
    health: Health = Health()  # schema/health.py, docs/health.md

    @model_validator(mode="after")
    def _cross_checks(self):
        problems = cross_field_problems(self)
        if problems:
            # The loader splits these back into one problem per field, each with its line.
            raise PydanticCustomError("cross_field", "; ".join(f"{p}: {m}" for p, m in problems),
                                      {"problems": problems})
        return self

    @property
    def world_size(self) -> int:
        """Training processes: one per GPU; the CPU reference trainer one per node."""
        if self.model.reference is not None:
            return self.cluster.nodes
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.training.model_parallel_size

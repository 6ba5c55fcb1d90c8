"""The campaign's non-training jobs as ``SlurmJobOperator`` arguments. Pure.

Each function returns ``{"command", "job", "result_file", "environment"}`` for one stage;
the command runs a ``jobscripts`` entry point, with the cluster's Python (``$PP_PYTHON``) on
the host or the image's in a container, where the stage's placement puts it
(operators/campaign/render/placement.py), and writes its result JSON into the job's run directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobscripts.hf_fetch import parse_hf_uri
from operators.campaign.render.layout import RESULT_FILE, Layout
from operators.campaign.render.paths import loaded_tokenizer
from operators.campaign.render.placement import stage_command, stage_launch
from operators.campaign.schema.rules import recipe_hf_model

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

MERGED_PREFIX = "corpus"  # -> <data dir>/corpus_text_document.bin/.idx
EVAL_DOCUMENTS = 32  # held-out documents scored per evaluation (the split's first ones)


def stage_job(campaign: Campaign, cpus: int | None = None) -> dict:
    """sbatch options from the cluster section itself: the reference trainer's segment job
    (the other stages are placed by operators/campaign/render/placement.py)."""
    c = campaign.cluster
    job = {name: getattr(c, name) for name in ("partition", "account", "qos")
           if getattr(c, name) is not None}
    job["time"] = c.time_limit
    if cpus or c.cpus_per_task:
        job["cpus_per_task"] = cpus or c.cpus_per_task
    if c.mem:
        job["mem"] = c.mem
    return job


def _stage(campaign: Campaign, module: str, *args: object, stage: str = "data",
           cpus: int | None = None) -> dict:
    # cluster.environment is the host's, for every job of the campaign, not only training:
    # ingest needs AWS_ENDPOINT_URL / AWS_CONFIG_FILE, HF_HUB_OFFLINE and the like too. The
    # container's own environment is exported inside the container only (placement.py).
    launch = stage_launch(campaign, stage, cpus)
    return {"command": stage_command(campaign, launch, module, *args, "--result", RESULT_FILE),
            "job": launch.job, "result_file": RESULT_FILE,
            "environment": dict(campaign.cluster.environment)}


def demo_corpus(campaign: Campaign, layout: Layout) -> dict:
    return _stage(campaign, "jobscripts.demo_corpus", "--output-dir", layout.corpus)


def ingest_source_args(source: str, layout: Layout) -> list[str]:
    """``data.source`` as ingest flags: an hf:// URI becomes ``--hf-repo/--hf-allow-pattern
    [/--hf-revision]``, everything else (a path, a glob, s3://) is ``--input``."""
    if source == "demo":
        return ["--input", layout.corpus]
    if source.startswith("hf://"):
        hf = parse_hf_uri(source)  # the schema already accepted it: this cannot fail
        args = ["--hf-repo", hf.repo_id, "--hf-allow-pattern", hf.allow_pattern]
        return args + (["--hf-revision", hf.revision] if hf.revision else [])
    return ["--input", source]


def _ingest_args(campaign: Campaign, layout: Layout) -> list:
    d = campaign.data
    args = [*ingest_source_args(d.source, layout), "--output-dir", layout.ingest,
            "--min-chars", d.min_doc_chars, "--max-chars", d.max_doc_chars]
    return [*args, "--no-dedup"] if not d.dedup else args


def _ingest_tasks(campaign: Campaign) -> int:
    """Array tasks of the ingest: ``data.array_tasks`` for a source on the cluster's disks;
    a remote one (s3://, hf://) is fetched by one job into one folder, so 1."""
    remote = "://" in campaign.data.source
    return 1 if remote else campaign.data.array_tasks


def ingest(campaign: Campaign, layout: Layout) -> dict:
    """The ingest task's job: all of it, else the job after the array (:func:`ingest_array`)
    that checks every task, runs the global dedup and writes the result."""
    tasks = _ingest_tasks(campaign)
    extra = ["--merge-tasks", tasks] if tasks > 1 else []
    return _stage(campaign, "jobscripts.ingest", *_ingest_args(campaign, layout), *extra)


def ingest_array(campaign: Campaign, layout: Layout) -> dict | None:
    """With ``data.array_tasks`` > 1 and a source on the cluster: the array whose task I
    ingests the I-th contiguous group of input files (each task's result is
    ``result_I.json``); None for one task."""
    tasks = _ingest_tasks(campaign)
    if tasks == 1:
        return None
    stage = _stage(campaign, "jobscripts.ingest", *_ingest_args(campaign, layout),
                   "--array-tasks", tasks)
    return {**stage, "job": {**stage["job"], "array": f"0-{tasks - 1}"}, "tasks": tasks}


def raw_gate(campaign: Campaign, layout: Layout) -> dict:
    d, g = campaign.data, campaign.data.gate
    return _stage(campaign, "jobscripts.raw_gate", "--input", layout.jsonl,
                  "--output-dir", layout.raw_gate, "--sample-size", g.sample_size,
                  "--min-chars", d.min_doc_chars, "--max-chars", d.max_doc_chars,
                  "--max-duplicate-rate", g.max_duplicate_rate,
                  "--max-replacement-share", g.max_replacement_char_share,
                  "--max-nonprintable-share", g.max_nonprintable_share)


def tokenizer(campaign: Campaign, layout: Layout) -> dict:
    t = campaign.data.tokenizer
    if t.train is not None:
        args = ["--input", layout.jsonl, "--vocab-size", t.train.vocab_size]
    else:
        args = ["--from-dir", t.path]
    return _stage(campaign, "jobscripts.train_tokenizer", "--output-dir", layout.tokenizer, *args)


def tokenize(campaign: Campaign, layout: Layout) -> dict:
    """The tokenize task's job: all of it (one array task), else the merge after the array
    (:func:`tokenize_array`), which tokenizes nothing and writes the manifest."""
    workers, tasks = campaign.data.tokenize_workers, campaign.data.array_tasks
    common = ["--input", layout.jsonl, "--tokenizer", layout.tokenizer,
              "--output-dir", layout.tokens,
              # One merged prefix: Megatron's blend of per-shard prefixes gives a shard
              # with no validation documents weight 0, which it refuses.
              "--merge", MERGED_PREFIX]
    if tasks > 1:
        return _stage(campaign, "jobscripts.tokenize_megatron", *common, "--merge-tasks", tasks)
    return _stage(campaign, "jobscripts.tokenize_megatron", *common[:6], "--workers", workers,
                  *common[6:], cpus=workers)


def tokenize_array(campaign: Campaign, layout: Layout) -> dict | None:
    """With ``data.array_tasks`` > 1: the array whose task I tokenizes the I-th contiguous
    group of the ingested shards (``$SLURM_ARRAY_TASK_ID``; each task's result is
    ``result_I.json``), one per node as Slurm places them; None for one task."""
    workers, tasks = campaign.data.tokenize_workers, campaign.data.array_tasks
    if tasks == 1:
        return None
    stage = _stage(campaign, "jobscripts.tokenize_megatron", "--input", layout.jsonl,
                   "--tokenizer", layout.tokenizer, "--output-dir", layout.tokens,
                   "--workers", workers, "--array-tasks", tasks, cpus=workers)
    return {**stage, "job": {**stage["job"], "array": f"0-{tasks - 1}"}, "tasks": tasks}


def token_gate(campaign: Campaign, layout: Layout, ingest_result: str) -> dict:
    return _stage(campaign, "jobscripts.token_gate", "--dataset-dir", layout.tokens,
                  "--ingest-result", ingest_result, "--output-dir", layout.token_gate)


def export(campaign: Campaign, layout: Layout) -> dict:
    """Hugging Face safetensors from the latest complete checkpoint, verified after writing."""
    args = ["--checkpoint-root", layout.checkpoints, "--output", layout.hf_export,
            "--tokenizer", loaded_tokenizer(campaign, layout)]
    if campaign.model.recipe is not None:
        # The model the recipe was built from (its config.json, from HF_HOME offline), with
        # which Bridge maps the checkpoint back to HF names; the tokenizer folder has none.
        args += ["--bridge", "--hf-model", recipe_hf_model(campaign)]
    return _stage(campaign, "jobscripts.export_hf", *args, stage="export")


def heldout_data_args(campaign: Campaign, layout: Layout) -> list[str]:
    """Where evaluation finds the documents training never saw: the same prefixes the
    segments train on (the data stage's manifest, or the campaign's own prefixes), split as
    ``data.split`` splits them (jobscripts/eval_data.py picks the test or validation part)."""
    d = campaign.data
    if d.prefixes or d.blend:
        prefixes = d.prefixes or [b.prefix for b in d.blend]
        return [x for p in prefixes for x in ("--dataset", p)]
    return ["--manifest", d.manifest or layout.manifest]


def evaluate(campaign: Campaign, layout: Layout) -> dict:
    """Perplexity and bits per byte on held-out documents, plus sample completions."""
    backend = "vllm"  # the CPU build on the local cluster, the GPU image in production
    return _stage(campaign, "jobscripts.evaluate", "--model", layout.hf_export,
                  *heldout_data_args(campaign, layout), "--split", campaign.data.split,
                  "--max-model-len", campaign.training.seq_length,
                  "--backend", backend, "--max-documents", EVAL_DOCUMENTS,
                  "--max-new-tokens", 32, "--prompt", "The", "--output-dir", ".",
                  stage="evaluate")

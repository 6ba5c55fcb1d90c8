"""The campaign directory: where each stage of a campaign reads and writes on the cluster. The
one place that says (docs/contracts.md); RunPaths (paths.py) takes its roots from here.

    <remote_root>/<name>/          the campaign directory (else checkpoint.dir's parent)

    <campaign>/data/corpus/        the demo corpus (Parquet), when data.source is 'demo'
    <campaign>/data/ingest/        JSONL shards from ingestion (ingest/jsonl) and their logs
    <campaign>/data/raw_gate/      the raw-data gate's result and GX Data Docs
    <campaign>/data/tokenizer/     the trained (or copied) tokenizer
    <campaign>/data/               *_text_document.bin/.idx and manifest.json
    <campaign>/data/token_gate/    the tokenized-data gate's result
    <campaign>/checkpoints/        iter_XXXXXXX/ + latest_checkpointed_iteration.txt
    <campaign>/pinned_manifest.json  the manifest segment 1 trained on
    <campaign>/mlflow_run_id       the campaign's MLflow parent run
    <campaign>/segments.jsonl      one line per finished segment (segment.json + Slurm record)
    <campaign>/export/hf/          Hugging Face export of the final checkpoint
    <campaign>/completed.json      the iteration whose export, evaluation and registration ran
    <campaign>/tensorboard/        one event stream for all segments
    <campaign>/data_cache/         Megatron's dataset index cache
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from jobscripts.job_files import MANIFEST_FILE, RESULT_FILE, TRACKER_FILENAME

if TYPE_CHECKING:  # paths.py imports this module for the directory names
    from operators.campaign.render.paths import RunPaths
    from operators.campaign.schema.config import Campaign

# RESULT_FILE is re-exported: stage code names it beside the layout it writes into.
__all__ = ["CHECKPOINTS", "DATA", "DATA_CACHE", "RESULT_FILE", "TENSORBOARD", "Layout",
           "campaign_dir", "checkpoint_dir", "manifest_path"]

# Directory names under the campaign directory.
DATA = "data"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
DATA_CACHE = "data_cache"


def campaign_dir(campaign: Campaign) -> str:
    """``<remote_root>/<name>``; without remote_root (the schema then requires checkpoint.dir)
    the checkpoint dir's parent."""
    root = campaign.cluster.remote_root
    if root:
        return posixpath.join(root, campaign.name)
    return posixpath.dirname(campaign.checkpoint.dir.rstrip("/"))


def checkpoint_dir(campaign: Campaign) -> str:
    return campaign.checkpoint.dir or posixpath.join(campaign_dir(campaign), CHECKPOINTS)


def manifest_path(data_dir: str) -> str:
    return posixpath.join(data_dir, MANIFEST_FILE)


class Layout:
    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        d = paths.data_dir
        self.corpus = posixpath.join(d, "corpus")
        self.ingest = posixpath.join(d, "ingest")
        self.jsonl = posixpath.join(self.ingest, "jsonl")
        self.raw_gate = posixpath.join(d, "raw_gate")
        self.tokenizer = posixpath.join(d, "tokenizer")
        self.tokens = d
        self.manifest = paths.manifest
        self.token_gate = posixpath.join(d, "token_gate")
        c = paths.campaign_dir
        self.checkpoints = paths.checkpoint_dir
        self.tracker = posixpath.join(self.checkpoints, TRACKER_FILENAME)
        self.pinned_manifest = posixpath.join(c, "pinned_manifest.json")
        self.mlflow_run_id = posixpath.join(c, "mlflow_run_id")
        self.segments_log = posixpath.join(c, "segments.jsonl")
        self.export = posixpath.join(c, "export")
        self.hf_export = posixpath.join(self.export, "hf")
        self.completed = posixpath.join(c, "completed.json")

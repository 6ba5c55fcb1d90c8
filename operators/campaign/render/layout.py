"""The campaign directory: where each stage of a campaign reads and writes on the cluster. The
one place that says (docs/contracts.md). What a run learns only when it runs (the data
stage's prefixes, the trained tokenizer, the shipped code) is paths.py's ``RunInputs``.

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
    <campaign>/failed_segments.jsonl  one line per segment job whose task failed (goodput's)
    <campaign>/export/hf/          Hugging Face export of the final checkpoint
    <campaign>/completed.json      the iteration whose export, evaluation and registration ran
    <campaign>/tensorboard/        one event stream for all segments
    <campaign>/data_cache/         Megatron's dataset index cache
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobscripts.job_files import MANIFEST_FILE, RESULT_FILE, TRACKER_FILENAME
from operators.campaign.schema.fields import checked_path

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

# RESULT_FILE is re-exported: stage code names it beside the layout it writes into.
__all__ = ["CHECKPOINTS", "DATA", "DATA_CACHE", "RESULT_FILE", "TENSORBOARD", "Layout",
           "campaign_dir", "checkpoint_dir"]

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


class _Under:
    """A path of the layout: ``parts`` joined under another of its paths, ``base``."""

    def __init__(self, base: str, *parts: str) -> None:
        self.base, self.parts = base, parts

    def __get__(self, layout: Layout | None, owner: type) -> str:
        if layout is None:  # on the class: the descriptor itself has no path
            raise AttributeError("a Layout path is read from a Layout")
        return posixpath.join(getattr(layout, self.base), *self.parts)


@dataclass(frozen=True)
class Layout:
    """A campaign's directories and files on the cluster, from its two roots."""

    campaign_dir: str
    checkpoint_dir: str

    def __post_init__(self) -> None:
        # These reach YAML and shell lines; the schema's rules apply to them too.
        checked_path("layout.campaign_dir", self.campaign_dir)
        checked_path("layout.checkpoint_dir", self.checkpoint_dir)

    @classmethod
    def for_campaign(cls, campaign: Campaign) -> Layout:
        return cls(campaign_dir(campaign), checkpoint_dir(campaign))

    data_dir = _Under("campaign_dir", DATA)
    corpus = _Under("data_dir", "corpus")
    ingest = _Under("data_dir", "ingest")
    jsonl = _Under("ingest", "jsonl")
    raw_gate = _Under("data_dir", "raw_gate")
    tokenizer = _Under("data_dir", "tokenizer")
    tokens = _Under("data_dir")  # the Megatron .bin/.idx files sit in the data dir itself
    manifest = _Under("data_dir", MANIFEST_FILE)
    token_gate = _Under("data_dir", "token_gate")
    checkpoints = _Under("checkpoint_dir")
    tracker = _Under("checkpoint_dir", TRACKER_FILENAME)
    pinned_manifest = _Under("campaign_dir", "pinned_manifest.json")
    mlflow_run_id = _Under("campaign_dir", "mlflow_run_id")
    segments_log = _Under("campaign_dir", "segments.jsonl")
    failed_segments_log = _Under("campaign_dir", "failed_segments.jsonl")
    export = _Under("campaign_dir", "export")
    hf_export = _Under("export", "hf")
    completed = _Under("campaign_dir", "completed.json")
    tensorboard_dir = _Under("campaign_dir", TENSORBOARD)
    data_cache_dir = _Under("campaign_dir", DATA_CACHE)

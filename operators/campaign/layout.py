"""Where each stage of a campaign reads and writes on the cluster. The one place that says.

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
"""

from __future__ import annotations

import posixpath

from operators.campaign.paths import RunPaths

RESULT_FILE = "result.json"  # every stage job writes its result here, in its run dir


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
        self.tracker = posixpath.join(self.checkpoints, "latest_checkpointed_iteration.txt")
        self.pinned_manifest = posixpath.join(c, "pinned_manifest.json")
        self.mlflow_run_id = posixpath.join(c, "mlflow_run_id")
        self.segments_log = posixpath.join(c, "segments.jsonl")
        self.export = posixpath.join(c, "export")
        self.hf_export = posixpath.join(self.export, "hf")
        self.completed = posixpath.join(c, "completed.json")

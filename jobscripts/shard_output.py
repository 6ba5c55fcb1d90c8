"""One tokenized shard on disk: written atomically, marked done, recognised on a rerun.

A shard's ``.bin/.idx`` are built under temporary names and renamed into place;
only then is ``<prefix>.done.json`` written. A rerun trusts a shard only if its
marker names the same input file (path, size, mtime) and settings, and the files
on disk still match the marker (``.bin`` size, ``.idx`` sha256): a job killed
mid-shard, or an input that changed, means the shard is redone.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobscripts.common import log
from jobscripts.megatron_tokenizer import sha256_file
from jobscripts.results import read_json, write_json_atomic


def marker_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".done.json")


# One array task's done record: which shards it owned and each one's done marker. A retried
# array's task finds it (and every shard it names still finished) and does nothing; the merge
# requires all of them. Under OUT/, beside the shards' own markers.
TASKS_DIR = ".array_tasks"


def task_record_path(out: Path, task: int, tasks: int) -> Path:
    return out / TASKS_DIR / f"task_{task:05d}_of_{tasks:05d}.done.json"


def task_shards(shards: list, task: int, tasks: int) -> list:
    """Array task ``task``'s contiguous share of the sorted shard list (maybe empty)."""
    return shards[task * len(shards) // tasks : (task + 1) * len(shards) // tasks]


def task_finished(out: Path, task: int, tasks: int, owned: list[tuple[Path, dict]]) -> dict | None:
    """The task's done record when it names exactly ``owned`` (prefix, identity) and every one
    of those shards is still finished; else None (the task is redone, shard markers decide)."""
    path = task_record_path(out, task, tasks)
    if not path.exists():
        return None
    record = read_json(path)
    if [s["prefix"] for s in record["shards"]] != [prefix.name for prefix, _i in owned]:
        return None
    for prefix, identity in owned:
        if finished(prefix, identity) is None:
            return None
    return record


def mark_task_done(out: Path, task: int, tasks: int, records: list[dict]) -> None:
    write_json_atomic(task_record_path(out, task, tasks),
                      {"task": task, "tasks": tasks, "shards": records})


def shard_identity(path: Path, settings: dict) -> dict:
    stat = path.stat()
    return {
        "input": str(path),
        "input_bytes": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        **settings,
    }


def finished(prefix: Path, identity: dict) -> dict | None:
    """The shard's done marker if it is complete and was made from the same input."""
    marker = marker_path(prefix)
    if not marker.exists():
        return None
    done = read_json(marker)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    if any(done.get(k) != v for k, v in identity.items()):
        return None
    if (
        not (bin_path.exists() and idx_path.exists())
        or bin_path.stat().st_size != done["bin_bytes"]
    ):
        return None
    return done if sha256_file(idx_path) == done["idx_sha256"] else None


def mark_done(record: dict, directory: Path) -> None:
    write_json_atomic(marker_path(directory / record["prefix"]), record)


def finalize(builder, tmp: Path, prefix: Path, record: dict, hash_bin: bool, mark=True) -> dict:
    """Close the builder, move the files into place; write the done marker last if ``mark``."""
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    record = {
        **record,
        "prefix": prefix.name,
        "bin_bytes": Path(f"{prefix}.bin").stat().st_size,
        "idx_sha256": sha256_file(f"{prefix}.idx"),
    }
    if hash_bin:
        record["bin_sha256"] = sha256_file(f"{prefix}.bin")
    if mark:
        mark_done(record, prefix.parent)
    return record


class ShardWriter:
    """One shard's output: an IndexedDatasetBuilder on temp files, moved into place at close."""

    def __init__(self, prefix: Path, identity: dict, dtype, facts: dict):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix, self.tmp = prefix, prefix.with_name(f".{prefix.name}.tmp")
        self.builder = IndexedDatasetBuilder(f"{self.tmp}.bin", dtype=dtype)
        self.record = {**identity, **facts, "documents": 0, "tokens": 0, "text_bytes": 0}

    def add(self, counts, tokens, splits: dict, text_bytes: int) -> int:
        """Write one encoded batch: the bytes and index entries ``add_document`` would write
        for each document in turn, written in one go: the batch's tokens are one contiguous
        array of the dataset's dtype already, and a call per document is main-thread time
        taken from the encoders, which share the cores with it."""
        builder = self.builder
        if tokens.dtype != builder.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, the dataset is {builder.dtype}")
        builder.data_file.write(memoryview(tokens))  # contiguous (one concatenate): no copy
        lengths, indices = builder.sequence_lengths, builder.document_indices
        for i, count in enumerate(counts.tolist()):
            if i in splits:
                lengths.extend(splits[i])
            elif count:
                lengths.append(count)
            indices.append(len(lengths))
        written = len(tokens)
        self.record["documents"] += len(counts)
        self.record["tokens"] += written
        self.record["text_bytes"] += text_bytes
        return written

    def close(self, hash_bin: bool) -> dict:
        """Files in place, not yet marked done: the caller marks them (mark_done)."""
        return finalize(self.builder, self.tmp, self.prefix, self.record, hash_bin, mark=False)


def merge(records: list[dict], out: Path, name: str, dtype, settings: dict, hash_bin: bool) -> dict:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = out / f"{name}_text_document"
    identity = {**settings, "parts": [r["idx_sha256"] for r in records]}
    if done := finished(prefix, identity):
        log(f"merged dataset {prefix} is up to date")
        return done
    tmp = prefix.with_name(f".{prefix.name}.tmp")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    for record in records:
        builder.add_index(str(out / record["prefix"]))
    totals = {k: sum(r[k] for r in records) for k in ("documents", "tokens", "text_bytes")}
    log(f"merged {len(records)} shards into {prefix}")
    return finalize(builder, tmp, prefix, {**identity, **totals}, hash_bin)

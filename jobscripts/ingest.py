"""Parquet shards (FineWeb layout) to JSONL shards with datatrove, with filters.

    python -m jobscripts.ingest --input DIR|GLOB|FILE|s3://...|hf://datasets/... --output-dir OUT
        [--min-chars 1] [--max-chars 0] [--no-dedup] [--tasks N] [--workers N]
        [--hf-repo REPO --hf-allow-pattern PAT ...] [--hf-revision REV] [--result PATH]
        [--array-tasks N [--array-task I] | --merge-tasks N]

The pipeline is the reference workflow's (``ParquetReader`` -> filters ->
``JsonlWriter``) run by ``LocalPipelineExecutor`` with its logs under
``OUT/logs``. Exact-duplicate removal is datatrove's three-stage ExactDedup
(signatures, find, filter): global across tasks and the same on every run.
JSONL is written uncompressed so tokenization can split shards by byte range.
A rerun with the same settings resumes (datatrove skips completed tasks); a rerun
with other settings into the same directory is refused.

Remote sources are fetched into ``OUT/download`` first (resumably) and read from there:
``s3://`` with boto3 (:mod:`jobscripts.s3_fetch`), a Hugging Face dataset with
``snapshot_download`` (:mod:`jobscripts.hf_fetch`; ``--input hf://...`` or the
``--hf-*`` flags). The reader gets the exact list of selected files, never "whatever is in
the directory".

Over nodes (a Slurm job array, operators/campaign/render/stages.py): ``--array-tasks N``
makes this one of N tasks; task I (``--array-task``, default ``$SLURM_ARRAY_TASK_ID``) runs
the I-th contiguous group of datatrove's ranks (one rank per input file by default: rank r
reads files r, r+T, ...) through the per-rank first stage: the whole pipeline without dedup,
the signature stage with it. Its result is ``result_I.json``, naming its input files from the
start. A rank's datatrove completion marker makes a retried task skip it, so a finished
task's files are not read again. ``--merge-tasks N`` is the job after the array: it
requires every rank of every task to be complete (else fails naming each unfinished task
and its files), then runs the rest (with dedup: the global find and the filter stage that
writes the JSONL) and writes the result once, last. The ranks, files and stages are the
single job's, so the JSONL is the single job's, byte for byte. Local inputs only: a remote
source is fetched by one job (``--array-tasks`` refuses it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

from datatrove.pipeline.filters.base_filter import BaseFilter

from jobscripts.array_task import (
    add_array_arguments,
    resolve_array_args,
)
from jobscripts.common import StepError, log, run_step
from jobscripts.results import read_json, write_json_atomic
from jobscripts.shard_output import task_shards

GLOB_CHARS = set("*?[")


def split_input(spec: str) -> tuple[str, str]:
    """'dir/000_*.parquet' -> ('dir', '000_*.parquet'); a bare directory gets '**/*.parquet'
    (every Parquet file below it); one file 'dir/x.parquet' -> ('dir', 'x.parquet')."""
    parts = spec.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if GLOB_CHARS.intersection(part):
            return "/".join(parts[:i]) or "/", "/".join(parts[i:])
    if spec.endswith(".parquet") and os.path.isfile(spec):
        return os.path.dirname(spec) or ".", os.path.basename(spec)
    return spec.rstrip("/"), "**/*.parquet"


def doc_text(doc) -> str:  # a named function: datatrove reads its return annotation
    return doc.text


class LengthFilter(BaseFilter):
    """Drops documents outside [min_chars, max_chars], counting each reason apart."""

    name = "📏 Length"

    def __init__(self, min_chars: int, max_chars: int):
        super().__init__()
        self.min_chars, self.max_chars = min_chars, max_chars

    def filter(self, doc):
        if len(doc.text) < self.min_chars:
            return False, "too_short"
        if self.max_chars and len(doc.text) > self.max_chars:
            return False, "too_long"
        return True


def count_rows(folder, files: list[str]) -> int:
    """Rows in the input, from the Parquet footers (datatrove skips empty texts silently)."""
    import pyarrow.parquet as pq

    total = 0
    for name in files:
        with folder.open(name, "rb") as handle:
            total += pq.ParquetFile(handle).metadata.num_rows
    return total


def stage_stats(logging_dir: Path) -> list[dict]:
    """Per-step stats summed over every task, including tasks done by an earlier run."""
    merged: list[dict] = []
    for path in sorted((logging_dir / "stats").glob("*.json")):
        for i, step in enumerate(json.loads(path.read_text())):
            if i == len(merged):
                merged.append({"name": step["name"], "stats": {}})
            for key, value in step["stats"].items():
                if isinstance(value, dict) and "total" in value:
                    value = value["total"]
                if isinstance(value, int | float):
                    merged[i]["stats"][key] = merged[i]["stats"].get(key, 0) + value
    return merged


def build_executors(args, folder: str, paths_file: Path, out: Path, tasks: int, workers: int,
                    ranks: list[int] | None = None):
    """The pipeline's executors in order; with ``ranks`` (an array task's contiguous group),
    only the first, per-rank stage, limited to those ranks."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import JsonlWriter

    def head():  # reader + filters, identical in the signature and the filter stage
        reader = ParquetReader(
            folder, paths_file=str(paths_file), text_key=args.text_key, id_key=args.id_key
        )
        return [reader, LengthFilter(args.min_chars, args.max_chars)]

    writer = JsonlWriter(str(out / "jsonl"), output_filename="${rank}.jsonl", compression=None)
    logs = out / "logs"
    # fork, not datatrove's forkserver default: each forkserver worker re-imports datatrove,
    # 20 s for three small stages here against 3 s; the parent holds no threads yet.
    common = {"tasks": tasks, "workers": workers, "start_method": "fork"}
    if ranks is not None:  # datatrove runs ranks offset..offset+local_tasks-1 of ``tasks``
        common.update(local_tasks=len(ranks), local_rank_offset=ranks[0])
    if not args.dedup:
        return [
            LocalPipelineExecutor([*head(), writer], logging_dir=str(logs / "ingest"), **common)
        ]

    from datatrove.pipeline.dedup.exact_dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
    )
    from datatrove.utils.hashing import HashConfig

    config = ExactDedupConfig(content_getter=doc_text, hash_config=HashConfig(hash_fc="sha1"))
    sigs, dups = str(out / "dedup" / "signatures"), str(out / "dedup" / "duplicates")
    first = LocalPipelineExecutor(
        [*head(), ExactDedupSignature(sigs, config)], logging_dir=str(logs / "signatures"), **common
    )
    find = LocalPipelineExecutor(
        [ExactFindDedups(sigs, dups, config)], tasks=1, workers=1, logging_dir=str(logs / "find")
    )
    last = LocalPipelineExecutor(
        [*head(), ExactDedupFilter(dups, config), writer],
        logging_dir=str(logs / "ingest"),
        **common,
    )
    return [first] if ranks is not None else [first, find, last]


def settings_guard(out: Path, settings: dict, overwrite: bool) -> None:
    """Refuse to resume a run made with other settings: datatrove would skip its tasks."""
    path = out / "ingest_settings.json"
    if path.exists() and read_json(path) != settings:
        if not overwrite:
            raise StepError(
                f"{out} holds an ingest run with other settings ({path}); "
                "use a new --output-dir or pass --overwrite"
            )
        for sub in ("jsonl", "logs", "dedup"):
            shutil.rmtree(out / sub, ignore_errors=True)
    write_json_atomic(path, settings)


def resolve_input(args, out: Path) -> tuple[str, list[str], dict]:
    """(local folder, its selected Parquet files relative to it, download figures).

    Remote sources are fetched into OUT/download first; a local one is listed in place.
    """
    download_dir = out / "download"
    if args.hf_repo or (args.input or "").startswith("hf://"):
        from jobscripts import hf_fetch

        if args.hf_repo:
            repo, patterns, revision = args.hf_repo, args.hf_allow_pattern, args.hf_revision
            if not patterns:  # without a pattern snapshot_download takes the whole repo
                raise StepError("--hf-repo needs at least one --hf-allow-pattern")
        else:
            try:
                hf = hf_fetch.parse_hf_uri(args.input)
            except ValueError as exc:
                raise StepError(str(exc)) from exc
            repo, patterns, revision = hf.repo_id, [hf.allow_pattern], hf.revision
        folder = download_dir / "hf"
        return str(folder), hf_fetch.download(repo, patterns, folder, revision), {}
    if not args.input:
        raise StepError("give --input, or --hf-repo with --hf-allow-pattern")
    if args.input.startswith("s3://"):
        from jobscripts import s3_fetch

        folder = download_dir / "s3"
        fetched = s3_fetch.download(args.input, folder)
        return str(folder), fetched.pop("files"), fetched
    if "://" in args.input:
        raise StepError(f"cannot read {args.input}: give a local path or glob, an s3:// URI "
                        "or an hf://datasets/ URI")
    from datatrove.io import get_datafolder

    folder, glob = split_input(args.input)
    files = get_datafolder(folder).list_files(glob_pattern=glob)
    if not files:
        raise StepError(f"no Parquet file matches {glob!r} under {folder}")
    return folder, files, {}


NOT_SETTINGS = ("result", "overwrite", "workers", "array_tasks", "array_task", "merge_tasks")


def write_paths_file(out: Path, files: list[str]) -> Path:
    """The reader's file list, sorted as datatrove's own listing is, so shards are the same.
    Array tasks on several nodes write it at once: replaced whole, never seen half written."""
    path, text = out / "input_files.txt", "".join(f"{name}\n" for name in sorted(files))
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.uname().nodename}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def rank_files(files: list[str], rank: int, tasks: int) -> list[str]:
    """The input files datatrove's reader gives ``rank`` of ``tasks`` (its paths file is
    read as lines ``rank``, ``rank + tasks``, ...: datatrove.io.get_shard_from_paths_file)."""
    return files[rank::tasks]


def task_ranks(tasks: int, task: int, array_tasks: int) -> list[int]:
    return task_shards(list(range(tasks)), task, array_tasks)


def array_task(args, folder: str, files: list[str], paths_file: Path, out: Path,
               tasks: int) -> dict:
    """One array task: its group of ranks through the per-rank first stage, nothing else."""
    task, array_tasks = args.array_task, args.array_tasks
    ranks = task_ranks(tasks, task, array_tasks)
    shards = [f for r in ranks for f in rank_files(sorted(files), r, tasks)]
    where = {"array_task": task, "array_tasks": array_tasks, "shards": shards,
             "ranks": ranks}
    # a task killed before its end still names its files
    write_json_atomic(args.result, {**where, "ok": False, "step": "ingest",
                                    "error": f"array task {task} started, did not finish"})
    if not ranks:
        log(f"array task {task} of {array_tasks}: no ranks ({tasks} in all)")
        return {**where, "ranks_done_before": 0}
    workers = args.workers or min(len(ranks), len(os.sched_getaffinity(0)))
    (executor,) = build_executors(args, folder, paths_file, out, tasks, workers, ranks)
    before = sum(map(executor.is_rank_completed, ranks))
    log(f"ingest array task {task} of {array_tasks}: ranks {ranks[0]}..{ranks[-1]} of {tasks} "
        f"({before} done before), files {shards}")
    try:
        executor.run()
    except Exception as exc:
        raise StepError(f"array task {task} (shards {', '.join(shards)}): "
                        f"{type(exc).__name__}: {exc}", where) from exc
    if undone := [r for r in ranks if not executor.is_rank_completed(r)]:
        raise StepError(f"array task {task} (shards {', '.join(shards)}): ranks {undone} did "
                        f"not complete (logs under {out / 'logs'})", where)
    return {**where, "ranks_done_before": before}


def require_tasks(executor, files: list[str], tasks: int, array_tasks: int) -> None:
    """StepError naming each array task with a rank not complete, and its files."""
    missing = []
    for task in range(array_tasks):
        ranks = task_ranks(tasks, task, array_tasks)
        if not all(map(executor.is_rank_completed, ranks)):
            shards = [f for r in ranks for f in rank_files(files, r, tasks)]
            missing.append(f"task {task} (shards {', '.join(shards)})")
    if missing:
        raise StepError(f"{len(missing)} of {array_tasks} array tasks did not finish: "
                        + "; ".join(missing), {"unfinished_tasks": missing})


def ingest(args: argparse.Namespace) -> dict:
    from datatrove.io import get_datafolder

    out = Path(args.output_dir)
    source = args.input or (f"hf://datasets/{args.hf_repo}"
                            + (f"@{args.hf_revision}" if args.hf_revision else "")
                            + f" {' '.join(args.hf_allow_pattern)}")
    if args.array_tasks and (args.hf_repo or "://" in (args.input or "")):
        raise StepError(f"--array-tasks: {source} is remote; it is fetched by one ingest job "
                        "(no --array-tasks)")
    folder, files, downloaded = resolve_input(args, out)
    data = get_datafolder(folder)
    tasks = args.tasks or min(len(files), 64)
    workers = args.workers or min(tasks, len(os.sched_getaffinity(0)))
    # How the work is spread (array flags, workers) is not part of what it makes.
    settings = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
    settings_guard(out, {**settings, "tasks": tasks}, args.overwrite)
    paths_file = write_paths_file(out, files)
    if args.array_tasks:
        return array_task(args, folder, files, paths_file, out, tasks)
    log(f"ingest: {len(files)} files under {folder}, {tasks} tasks, {workers} workers")

    executors = build_executors(args, folder, paths_file, out, tasks, workers)
    if args.merge_tasks:  # after the array: its per-rank stage must be complete everywhere
        require_tasks(executors[0], sorted(files), tasks, args.merge_tasks)
    for executor in executors:
        executor.run()
    rows = count_rows(data, files)  # after the forks: pyarrow's thread pools and fork do not mix
    stats = stage_stats(out / "logs" / "ingest")
    by_name = {s["name"]: s["stats"] for s in stats}
    read = next(s["stats"] for s in stats if "Parquet" in s["name"]).get("documents", 0)
    length = next(v for k, v in by_name.items() if "Length" in k)
    dedup = next((v for k, v in by_name.items() if "stage 3" in k), {})
    written = next(v for k, v in by_name.items() if "Jsonl" in k).get("total", 0)
    dropped = {
        "empty": rows - read,
        "too_short": length.get("dropped_too_short", 0),
        "too_long": length.get("dropped_too_long", 0),
        "duplicate": dedup.get("dropped", 0),
    }
    if rows - sum(dropped.values()) != written:
        raise StepError(
            f"document counts do not add up: {rows} in, {dropped} dropped, {written} out"
        )
    outputs = sorted((out / "jsonl").glob("*.jsonl"))
    log(f"ingest: {rows} documents in, {written} out, dropped {dropped}")
    return {
        "input": source,
        "input_files": len(files),
        "downloaded": downloaded,
        "output_dir": str(out),
        "jsonl_files": [str(p) for p in outputs],
        "jsonl_bytes": sum(p.stat().st_size for p in outputs),
        "docs_in": rows,
        "docs_out": written,
        "dropped": dropped,
        "filters": {"min_chars": args.min_chars, "max_chars": args.max_chars, "dedup": args.dedup},
        "array_tasks": args.merge_tasks,
        "settings_sha256": hashlib.sha256(
            json.dumps(settings, sort_keys=True).encode()
        ).hexdigest(),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.ingest", description=__doc__)
    p.add_argument("--input", help="Parquet directory, glob or file, s3:// prefix or glob, or "
                   "hf://datasets/ORG/NAME[@REV]/<path or glob>")
    p.add_argument("--output-dir", required=True, help="JSONL goes to OUT/jsonl, logs to OUT/logs")
    p.add_argument("--text-key", default="text")
    p.add_argument("--id-key", default="id")
    p.add_argument("--min-chars", type=int, default=1, help="drop shorter documents")
    p.add_argument("--max-chars", type=int, default=0, help="drop longer documents (0: no limit)")
    p.add_argument("--no-dedup", dest="dedup", action="store_false", help="keep exact duplicates")
    p.add_argument("--tasks", type=int, default=0, help="datatrove tasks (default: one per file)")
    p.add_argument("--workers", type=int, default=0, help="tasks run at once (default: CPUs)")
    p.add_argument("--overwrite", action="store_true", help="discard a run with other settings")
    p.add_argument("--hf-repo", help="Hugging Face dataset repo to download first (needs network)")
    p.add_argument("--hf-allow-pattern", action="append", default=[], help="files to download")
    p.add_argument("--hf-revision", help="branch, tag or commit of --hf-repo")
    add_array_arguments(p, "run as one of N array tasks: this task's group of ranks through "
                           "the per-rank first stage only",
                        "the job after N array tasks: require every rank, run the rest")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    p.add_argument("--result", help="where to write the result JSON (default: "
                   "<output dir>/ingest.json; an array task adds _<task> to its name)")
    args = p.parse_args(argv)
    if args.array_tasks and args.overwrite:  # one task would delete the others' work
        p.error("--overwrite cannot be used with --array-tasks")
    default = Path(args.output_dir) / "ingest.json"
    resolve_array_args(p, args, default)
    return run_step("ingest", args, default, ingest)


if __name__ == "__main__":
    raise SystemExit(main())

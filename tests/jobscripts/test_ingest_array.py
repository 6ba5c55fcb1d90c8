"""Ingest as a job array (issue 16 part 4), in this process: ``--array-tasks N`` tasks run in
any order, then ``--merge-tasks N``; the JSONL is the single job's byte for byte (dedup on:
the global find runs after every task's signatures); a retried task whose ranks are complete
reads nothing again; a merge with a task missing fails naming it and its files; a remote
source is refused (it is fetched by one job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.data_stage import ok, run_main

FILES, TASKS = 4, 3  # files 0 | 1 | 2, 3


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> Path:
    from jobscripts.demo_corpus import main

    out = tmp_path_factory.mktemp("ingest-array") / "parquet"
    ok(main, ["--output-dir", str(out), "--target-bytes", "150000", "--shards", str(FILES)],
       out.parent / "demo.json")
    return out


def _ingest(parquet: Path, out: Path, *extra: str) -> tuple[int, dict]:
    from jobscripts.ingest import main

    argv = ["--input", str(parquet), "--output-dir", str(out), "--min-chars", "10",
            "--workers", "1", *extra]
    code, payload, _ = run_main(main, argv, out.parent / f"{out.name}.json")
    return code, payload


def _task(parquet: Path, out: Path, task: int) -> dict:
    """One array task, as Slurm's array runs it; its result is ``task_<task>.json``."""
    from jobscripts.ingest import main

    argv = ["--input", str(parquet), "--output-dir", str(out), "--min-chars", "10",
            "--workers", "1", "--array-tasks", str(TASKS), "--array-task", str(task)]
    code = main([*argv, "--result", str(out.parent / "task.json")])
    result = json.loads((out.parent / f"task_{task}.json").read_text())
    assert code == 0, result
    return result


def test_the_array_then_its_merge_write_the_single_jobs_jsonl_and_a_retry_redoes_nothing(
        parquet, tmp_path):
    code, single = _ingest(parquet, tmp_path / "single")
    assert code == 0, single
    arr = tmp_path / "array"
    tasks = {t: _task(parquet, arr, t) for t in (2, 0, 1)}  # any order
    assert [tasks[t]["shards"] for t in range(TASKS)] == [
        ["000_00000.parquet"], ["000_00001.parquet"], ["000_00002.parquet", "000_00003.parquet"]]
    assert all(r["ranks_done_before"] == 0 for r in tasks.values())
    assert not (arr / "jsonl").exists()  # with dedup the JSONL waits for the global find
    code, merged = _ingest(parquet, arr, "--merge-tasks", str(TASKS))
    assert code == 0, merged
    assert merged["array_tasks"] == TASKS
    for key in ("docs_in", "docs_out", "dropped", "input_files"):
        assert merged[key] == single[key], key
    names = [Path(p).name for p in single["jsonl_files"]]
    assert [Path(p).name for p in merged["jsonl_files"]] == names and len(names) == FILES
    for name in names:
        assert (arr / "jsonl" / name).read_bytes() == (tmp_path / "single" / "jsonl" /
                                                       name).read_bytes()
    # a retried array: the finished task's ranks are skipped, its signatures not rewritten
    signatures = sorted((arr / "dedup" / "signatures").rglob("*"))
    stamps = [p.stat().st_mtime_ns for p in signatures]
    again = _task(parquet, arr, 2)
    assert again["ranks_done_before"] == 2 and again["ranks"] == [2, 3]
    assert [p.stat().st_mtime_ns for p in sorted((arr / "dedup" / "signatures").rglob("*"))] \
        == stamps


def test_a_merge_with_an_unfinished_task_fails_naming_it_and_its_files(parquet, tmp_path):
    out = tmp_path / "partial"
    for task in (0, 2):
        _task(parquet, out, task)
    code, result = _ingest(parquet, out, "--merge-tasks", str(TASKS))
    assert code == 1
    assert result["error"] == ("1 of 3 array tasks did not finish: task 1 "
                               "(shards 000_00001.parquet)"), result
    assert not (out / "jsonl").exists()


def test_an_array_task_refuses_a_remote_source(tmp_path):
    from jobscripts.ingest import main

    argv = ["--input", "s3://bucket/raw/", "--output-dir", str(tmp_path / "out"),
            "--array-tasks", "2", "--array-task", "0", "--result", str(tmp_path / "r.json")]
    assert main(argv) == 1
    error = json.loads((tmp_path / "r_0.json").read_text())["error"]
    assert error.startswith("--array-tasks: s3://bucket/raw/ is remote"), error

"""Tokenization as a Slurm job array (issue 16 part 4), the jobscript's side, in this process.

The same corpus tokenized by one job and by three array tasks plus the merge gives the same
bytes (every shard's and the merged ``.bin``/``.idx``) and the same manifest content; a task
whose done record stands does nothing on a retry of the array; the merge refuses to run
before every task finished, naming each missing task and its shards; a failing task names
itself and its shards in its own result file (``result_<task>.json``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.data_stage import ok, run_main, tokenize_argv

SHARDS = 5  # over 3 tasks: groups of 1, 2 and 2 shards
TASKS = 3
CONTENT = ("settings", "prefixes", "shards", "total", "fingerprint")


@pytest.fixture(scope="module")
def shards(ingested, tmp_path_factory) -> Path:
    """The ingested corpus re-cut into ``SHARDS`` JSONL shards (enough for three tasks)."""
    lines = [line for path in ingested["jsonl_files"]
             for line in Path(path).read_text(encoding="utf-8").splitlines()]
    folder = tmp_path_factory.mktemp("array-shards")
    for i in range(SHARDS):
        part = lines[i * len(lines) // SHARDS:(i + 1) * len(lines) // SHARDS]
        (folder / f"{i:05d}.jsonl").write_text("\n".join(part) + "\n", encoding="utf-8")
    return folder


def _argv(shards: Path, tokenizer: dict, out: Path, *extra: str) -> list[str]:
    return [*tokenize_argv(shards, tokenizer["tokenizer_dir"], out), "--workers", "2",
            "--merge", "corpus", *extra]


def _task(shards, tokenizer, out, task: int, tasks: int = TASKS) -> dict:
    from jobscripts.tokenize_megatron import main

    argv = _argv(shards, tokenizer, out, "--array-tasks", str(tasks), "--array-task", str(task))
    code = main([*argv, "--result", str(out.parent / f"{out.name}-result.json")])
    result = json.loads((out.parent / f"{out.name}-result_{task}.json").read_text())
    assert code == 0, result
    return result


@pytest.fixture(scope="module")
def single_and_array(shards, tokenizer, tmp_path_factory) -> dict:
    from jobscripts.tokenize_megatron import main

    base = tmp_path_factory.mktemp("array-vs-single")
    single = ok(main, _argv(shards, tokenizer, base / "single"), base / "single.json")
    tasks = [_task(shards, tokenizer, base / "array", t) for t in range(TASKS)]
    merged = ok(main, _argv(shards, tokenizer, base / "array", "--merge-tasks", str(TASKS)),
                base / "merge.json")
    return {"base": base, "single": single, "tasks": tasks, "merged": merged}


def test_array_output_is_byte_identical_to_the_single_job(single_and_array):
    base = single_and_array["base"]
    names = sorted(p.name for p in (base / "single").glob("*_text_document.*")
                   if p.suffix in (".bin", ".idx"))
    assert len(names) == 2 * (SHARDS + 1)  # every shard's prefix and the merged one
    assert names == sorted(p.name for p in (base / "array").glob("*_text_document.*")
                           if p.suffix in (".bin", ".idx"))
    for name in names:
        assert (base / "single" / name).read_bytes() == (base / "array" / name).read_bytes(), name
    one, many = (json.loads((base / d / "manifest.json").read_text()) for d in ("single", "array"))
    assert {k: one[k] for k in CONTENT} == {k: many[k] for k in CONTENT}
    assert single_and_array["merged"]["tokens"] == single_and_array["single"]["tokens"]
    assert single_and_array["merged"]["tokenized_shards"] == 0  # the merge encodes nothing


def test_each_task_tokenizes_its_own_group_of_shards(single_and_array):
    owned = [t["shards"] for t in single_and_array["tasks"]]
    assert owned == [["00000.jsonl"], ["00001.jsonl", "00002.jsonl"],
                     ["00003.jsonl", "00004.jsonl"]]
    assert [t["tokenized_shards"] for t in single_and_array["tasks"]] == [1, 2, 2]
    assert sum(t["tokens"] for t in single_and_array["tasks"]) == \
        single_and_array["single"]["tokens"]


def test_a_retried_array_redoes_only_unfinished_tasks(single_and_array, shards, tokenizer):
    out = single_and_array["base"] / "array"
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("0000*_text_document.*")}
    again = _task(shards, tokenizer, out, 1)
    assert again["task_done_before"] is True and again["tokenized_shards"] == 0
    assert before == {p.name: p.stat().st_mtime_ns for p in out.glob("0000*_text_document.*")}
    # A task whose shard was damaged since is redone, that shard only.
    Path(f"{out}/00004_text_document.idx").write_bytes(b"broken")
    redone = _task(shards, tokenizer, out, 2)
    assert redone["task_done_before"] is False and redone["tokenized_shards"] == 1
    assert redone["skipped_shards"] == 1


def test_the_merge_names_every_task_that_did_not_finish(shards, tokenizer, tmp_path):
    from jobscripts.tokenize_megatron import main

    out = tmp_path / "partial"
    _task(shards, tokenizer, out, 0)
    code, result, _ = run_main(main, _argv(shards, tokenizer, out, "--merge-tasks", str(TASKS)),
                               tmp_path / "merge.json")
    assert code == 1
    assert result["error"] == ("2 of 3 array tasks did not finish: task 1 (shards 00001.jsonl, "
                               "00002.jsonl); task 2 (shards 00003.jsonl, 00004.jsonl)")
    assert not (out / "manifest.json").exists()


def test_a_failed_task_names_itself_and_its_shards(shards, tokenizer, tmp_path):
    from jobscripts.tokenize_megatron import main

    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    with open(bad / "00002.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"text": "unterminated\n')
    out = tmp_path / "out"
    argv = _argv(bad, tokenizer, out, "--array-tasks", str(TASKS), "--array-task", "1")
    assert main([*argv, "--result", str(tmp_path / "result.json")]) == 1
    result = json.loads((tmp_path / "result_1.json").read_text())
    assert result["ok"] is False and result["array_task"] == 1
    assert result["shards"] == ["00001.jsonl", "00002.jsonl"]
    assert result["error"].startswith("array task 1 (shards 00001.jsonl, 00002.jsonl): ")
    assert "00002.jsonl:" in result["error"]  # the file and line it could not read
    assert not (out / ".array_tasks").exists() or not list((out / ".array_tasks").iterdir())


def test_array_task_flags_are_checked(shards, tokenizer, tmp_path, capsys):
    from jobscripts.tokenize_megatron import main

    argv = _argv(shards, tokenizer, tmp_path / "x", "--array-tasks", "3", "--array-task", "3")
    with pytest.raises(SystemExit):
        main(argv)
    assert "array task 3 is not in 0..2" in capsys.readouterr().err

"""Campaign files from careless and hostile hands (issue 14): each one is refused with the
project's error naming the file (and the field and line where there is one), never with a
bare exception, and values that used to pass and then break a job are refused at parse."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

from operators.campaign.render.summary import summary
from operators.campaign.schema.load import (
    MAX_ENTRIES,
    MAX_PROBLEMS,
    MAX_VALUES,
    CampaignConfigError,
    campaign_from_dict,
    load_campaign,
)
from tests.campaign.util import DEMO, LLAMA_8B, dump, edited, raw

DEMO_TEXT = DEMO.read_text()


def _refused(tmp_path: Path, data: bytes) -> CampaignConfigError:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(data)
    with pytest.raises(CampaignConfigError) as caught:
        load_campaign(path)
    assert all(p.located(str(path)) in str(caught.value) for p in caught.value.problems)
    return caught.value


def _line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


@pytest.mark.parametrize(("data", "fragment"), [
    (codecs.BOM_UTF16_LE + DEMO_TEXT.encode("utf-16-le"), "UTF-16"),
    (codecs.BOM_UTF16_BE + DEMO_TEXT.encode("utf-16-be"), "UTF-16"),
    (bytes(range(256)) * 4, "not a text file"),
    (b"\x89PNG\r\n\x1a\n" + bytes(200), "not a text file"),
])
def test_files_that_are_not_utf8_text(tmp_path, data, fragment) -> None:
    assert fragment in str(_refused(tmp_path, data))


def test_one_latin1_byte_in_a_comment_names_its_line(tmp_path) -> None:
    text = DEMO_TEXT.replace("# trigger it from the UI", "# d\xe9clench\xe9 depuis l'UI")
    error = _refused(tmp_path, text.encode("latin-1"))
    (problem,) = error.problems
    assert problem.line == _line_of(text, "depuis") and "not UTF-8" in problem.message


@pytest.mark.parametrize("key", ["? [a, b]\n: 1", "? {a: 1}\n: 1"])
@pytest.mark.parametrize("where", ["top", "section", "environment"])
def test_complex_keys_at_any_level(tmp_path, key, where) -> None:
    if where == "top":
        text = DEMO_TEXT + "\n" + key + "\n"
    elif where == "section":
        text = DEMO_TEXT.replace("training:\n", "training:\n" + _indent(key, 2) + "\n")
    else:
        text = DEMO_TEXT.replace("cluster:\n", "cluster:\n  environment:\n" + _indent(key, 4)
                                 + "\n")
    (problem,) = _refused(tmp_path, text.encode()).problems
    assert "plain name" in problem.message
    assert text.splitlines()[problem.line - 1].lstrip().startswith("?")


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


@pytest.mark.parametrize(("old", "new", "fragment"), [
    ("seed: 1234", "seed: " + "9" * 5000, "5000 digits"),
    ("seed: 1234", "seed: 0x" + "f" * 40, "out of range"),
    ("seed: 1234", "seed: 9223372036854775808", "out of range"),
    ("seed: 1234", "seed: 2026-02-30", "day is out of range"),
])
def test_numbers_yaml_cannot_hold(tmp_path, old, new, fragment) -> None:
    text = DEMO_TEXT.replace(old, new)
    (problem,) = _refused(tmp_path, text.encode()).problems
    assert fragment in problem.message and problem.line == _line_of(text, new)


def test_nesting_beyond_the_parser(tmp_path) -> None:
    assert "nest" in str(_refused(tmp_path, b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n"))


def test_an_oversized_file(tmp_path) -> None:
    assert "KiB" in str(_refused(tmp_path, DEMO_TEXT.encode() + b"#" * (2 << 20)))


def test_many_problems_are_cut_short(tmp_path) -> None:
    doc = raw(DEMO)
    doc["training"].update({f"unknown_{i}": i for i in range(MAX_ENTRIES - 100)})
    error = _refused(tmp_path, dump(doc).encode())
    assert len(error.problems) == MAX_PROBLEMS + 1
    assert error.problems[-1].message == f"... and {MAX_ENTRIES - 100 - MAX_PROBLEMS} more " \
                                         "problem(s)"


def _training_line(text: str) -> int:
    return _line_of(text, "training:")


def test_a_section_over_the_key_cap(tmp_path) -> None:
    # 40,000 unknown keys (issue 14.4): refused at the cap, before a tree is built.
    doc = raw(DEMO)
    doc["training"].update({f"unknown_{i}": i for i in range(40_000)})
    text = dump(doc)
    (problem,) = _refused(tmp_path, text.encode()).problems
    assert (problem.field, problem.line) == ("training", _training_line(text))
    assert problem.message == f"more than {MAX_ENTRIES} keys (the cap)"


def test_a_list_over_the_item_cap(tmp_path) -> None:
    doc = edited(raw(LLAMA_8B), {"cluster.container.binds": ["/a:/b"] * 50_000})
    text = dump(doc)
    (problem,) = _refused(tmp_path, text.encode()).problems
    assert (problem.field, problem.line) == ("cluster.container.binds",
                                             _line_of(text, "binds:"))
    assert problem.message == f"more than {MAX_ENTRIES} items (the cap)"


def test_a_flow_list_over_the_item_cap_names_its_line(tmp_path) -> None:
    text = DEMO_TEXT + "extra: [" + "1," * 300_000 + "1]\n"
    (problem,) = _refused(tmp_path, text.encode()).problems
    assert (problem.field, problem.line) == ("extra", len(DEMO_TEXT.splitlines()) + 1)


def test_too_many_values_in_small_sections(tmp_path) -> None:
    # No section over the key cap, but the file over the value cap.
    doc = raw(DEMO)
    for i in range(MAX_VALUES // MAX_ENTRIES + 1):
        doc[f"extra_{i}"] = {f"k{j}": j for j in range(MAX_ENTRIES // 2)}
    (problem,) = _refused(tmp_path, dump(doc).encode()).problems
    assert problem.message.startswith(f"the file holds more than {MAX_VALUES} YAML values")
    assert problem.field.startswith("extra_")


def test_aliases_count_each_time_they_are_used(tmp_path) -> None:
    # "Billion laughs": 10 levels of 10 aliases each; tiny as text, 10**10 values built.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    text = DEMO_TEXT + "\n".join(lines) + "\n"
    (problem,) = _refused(tmp_path, text.encode()).problems
    assert "alias counting each time" in problem.message


def _field_problems(base: Path, changes: dict) -> dict[str, str]:
    with pytest.raises(CampaignConfigError) as caught:
        campaign_from_dict(edited(raw(base), changes))
    return {p.field: p.message for p in caught.value.problems}


@pytest.mark.parametrize(("base", "changes", "field", "fragment"), [
    # values the validators or the DAG factory used to crash on
    (DEMO, {"cluster.time_limit": "9" * 400}, "cluster.time_limit", "Slurm time"),
    (DEMO, {"cluster.time_limit": "400-00:00:00"}, "cluster.time_limit", "365 days"),
    (DEMO, {"retries.train.retry_delay": 2**63}, "retries.train.retry_delay", "less than"),
    (DEMO, {"retries.data.retry_delay": 2**40}, "retries.data.retry_delay", "a day"),
    (DEMO, {"training.train_iters": 10**30}, "training.train_iters", "less than"),
    # inf / nan
    (DEMO, {"training.lr": float("inf")}, "training.lr", "finite"),
    (DEMO, {"training.weight_decay": float("nan")}, "training.weight_decay", "finite"),
    (DEMO, {"training.clip_grad": float("inf")}, "training.clip_grad", "finite"),
    (DEMO, {"data.gate.max_duplicate_rate": float("nan")}, "data.gate.max_duplicate_rate",
     "finite"),
    # options where a path, image, URI or tokenizer belongs
    (LLAMA_8B, {"cluster.container.image": "--fakeroot"}, "cluster.container.image", "'-'"),
    (LLAMA_8B, {"data.tokenizer.path": "--help"}, "data.tokenizer.path", "'-'"),
    (LLAMA_8B, {"data.source": "--output-dir=/etc"}, "data.source", "'-'"),
    (LLAMA_8B, {"data.source": "hf://datasets/a/b/-x.parquet"}, "data.source", "'-'"),
    (LLAMA_8B, {"data.manifest": "-m", "data.source": None}, "data.manifest", "'-'"),
    # environments a job cannot export
    (DEMO, {"cluster.environment": {"SHELLOPTS": "x"}}, "cluster.environment.SHELLOPTS",
     "reserved"),
    (DEMO, {"cluster.environment": {"UID": "0"}}, "cluster.environment.UID", "reserved"),
    (DEMO, {"cluster.environment": {"EUID": "0"}}, "cluster.environment.EUID", "reserved"),
    (DEMO, {"cluster.environment": {"PPID": "1"}}, "cluster.environment.PPID", "reserved"),
    (DEMO, {"cluster.environment": {"BASHOPTS": "x"}}, "cluster.environment.BASHOPTS",
     "reserved"),
    (DEMO, {"cluster.environment": {"IFS": "x"}}, "cluster.environment.IFS", "reserved"),
    (DEMO, {"cluster.environment": {"PP_PYTHON": "/usr/bin/python3"}},
     "cluster.environment.PP_PYTHON", "reserved"),
    (DEMO, {"cluster.environment": {"SLURM_JOB_ID": "1"}}, "cluster.environment.SLURM_JOB_ID",
     "reserved"),
    (DEMO, {"cluster.environment": {"BIG": "x" * 5000}}, "cluster.environment.BIG", "at most"),
    (DEMO, {"cluster.environment": {f"V{i}": "x" * 4000 for i in range(50)}},
     "cluster.environment", "Argument list too long"),
    # requests no node can meet, and checks that used to wait for the render
    (DEMO, {"cluster.cpus_per_task": 100_000}, "cluster.cpus_per_task", "any node"),
    (DEMO, {"data.tokenize_workers": 5000}, "data.tokenize_workers", "any node"),
    (LLAMA_8B, {"cluster.gpus_per_node": 1000}, "cluster.gpus_per_node", "any node"),
    (LLAMA_8B, {"stages.evaluate.gpus_per_node": 1000}, "stages.evaluate.gpus_per_node",
     "any node"),
    (LLAMA_8B, {"stages.data.cpus_per_task": 5000}, "stages.data.cpus_per_task", "any node"),
    (DEMO, {"cluster.time_limit": "10000"}, "cluster.time_limit", "days"),
    (DEMO, {"checkpoint.dir": "/", "cluster.remote_root": None}, "checkpoint.dir", "parent"),
    (DEMO, {"checkpoint.dir": "/ckpt", "cluster.remote_root": None}, "checkpoint.dir",
     "parent"),
    # unbounded work: counts and lists a DAG parse would build
    (DEMO, {"segments.max_per_run": 1_000_000}, "segments.max_per_run", "1000"),
    (LLAMA_8B, {"cluster.container.binds": ["/scratch/pretrain"] * 300},
     "cluster.container.binds", "at most 256"),
    (LLAMA_8B, {"cluster.setup": ["module load x"] * 300}, "cluster.setup", "at most 256"),
    (DEMO, {"data.source": None, "data.prefixes": ["/d/p"] * 5000}, "data.prefixes",
     "at most 4096"),
    # schedules, as Airflow reads them
    (DEMO, {"schedule": "0 0 31 2 *"}, "schedule", "never fires"),
    (DEMO, {"schedule": "0 0 30 2 *"}, "schedule", "never fires"),
    (DEMO, {"schedule": "\u0660 \u0663 * * *"}, "schedule", "not in 0-59"),
    (DEMO, {"schedule": "0 \u0663 * * *"}, "schedule", "not in 0-23"),
])
def test_accepted_but_wrong_is_now_refused(base, changes, field, fragment) -> None:
    problems = _field_problems(base, changes)
    assert field in problems, problems
    assert fragment in problems[field], problems[field]


@pytest.mark.parametrize("schedule", ["0 0 29 2 *", "0 3 * * *", "*/15 * * * 1-5"])
def test_rare_but_real_schedules_pass(schedule) -> None:
    assert campaign_from_dict(edited(raw(DEMO), {"schedule": schedule})).schedule == schedule


def test_huge_but_valid_numbers_still_summarise() -> None:
    c = campaign_from_dict(edited(raw(DEMO), {"training.train_iters": 2**62,
                                              "training.global_batch_size": 2**62}))
    assert "Tokens planned" in summary(c)

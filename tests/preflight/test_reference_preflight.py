"""The reference path's preflight (jobscripts/reference_preflight.py), run in-process: the run
config segment 1 would get, checked as the trainer loads it, plus the paths it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobscripts import reference_preflight


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"\x00" * 64)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    config = {"data_path": [str(tmp_path / "corpus_text_document")],
              "tokenizer_model": str(tmp_path / "tokenizer"),
              "save": str(tmp_path / "checkpoints"), "train_iters": 10,
              "global_batch_size": 8, "micro_batch_size": 4}
    (tmp_path / "run.json").write_text(json.dumps(config))
    return tmp_path


def _run(run_dir: Path, **changes) -> dict:
    config = json.loads((run_dir / "run.json").read_text())
    config.update(changes)
    (run_dir / "run.json").write_text(json.dumps(config))
    code = reference_preflight.main(["--config", str(run_dir / "run.json"),
                                     "--result", str(run_dir / "result.json")])
    result = json.loads((run_dir / "result.json").read_text())
    assert (code == 0) == result["ok"]
    return result


def test_a_config_that_will_run_passes(run_dir):
    result = _run(run_dir)
    assert result["ok"] and [c["check"] for c in result["checks"]] == ["run config", "paths"]


@pytest.mark.parametrize(("changes", "named"), [
    ({"trian_iters": 10}, "unknown config key(s): trian_iters"),
    ({"micro_batch_size": 3}, "global_batch_size must be a multiple of micro_batch_size"),
    ({"data_path": ["/nowhere/x_text_document"]}, "data_path: missing /nowhere/x_text_document"),
    ({"tokenizer_model": "/nowhere/tokenizer"}, "tokenizer_model: no directory /nowhere"),
    ({"save": "/proc/1/checkpoints"}, "save: /proc/1 is not writable"),
])
def test_a_config_that_would_not_run_fails_naming_the_field(run_dir, changes, named):
    result = _run(run_dir, **changes)
    assert not result["ok"] and named in result["error"], result["error"]

"""The reference path's preflight (jobscripts/reference_preflight.py), run in-process: the run
config segment 1 would get, checked as the trainer loads it, plus the paths it names."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from jobscripts import reference_preflight
from operators.campaign.adapters.code_ship import ship, with_pythonpath
from operators.campaign.dag.preflight import reference_preflight_job
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.schema.load import load_campaign
from operators.slurm.hook import SlurmHook
from tests.preflight.test_bridge_preflight import _run_job
from tests.support import cluster

CI_CAMPAIGN = Path(__file__).parents[1] / "campaigns" / "ci_campaign.yaml"


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


def test_the_rendered_reference_preflight_job_on_the_cluster(local_cluster, tmp_path,
                                                             monkeypatch):
    """The job the DAG submits for the CI campaign, with the shipped code and the cluster's
    Python: passes, then fails naming the tokenizer once that directory is gone."""
    root = Path(f"/home/pretrain/pp-test-reference-preflight-{uuid.uuid4().hex[:8]}")
    doc = yaml.safe_load(CI_CAMPAIGN.read_text())
    doc["cluster"]["remote_root"] = str(root)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    campaign = load_campaign(tmp_path / "c.yaml")
    layout = Layout.for_campaign(campaign)
    prefix = f"{layout.tokens}/corpus_text_document"
    Path(layout.tokenizer).mkdir(parents=True)
    Path(layout.tokenizer, "tokenizer.json").write_text("{}")
    for suffix in (".bin", ".idx"):
        Path(prefix + suffix).write_bytes(b"\x00" * 64)
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(root)], check=True)
    for name, value in cluster.connection_env().items():
        monkeypatch.setenv(name, value)
    hook = SlurmHook(cluster.CONN_ID)
    try:
        kwargs = reference_preflight_job(campaign, layout, RunInputs.of([prefix]), []).to_json()
        env = {"PP_PYTHON": local_cluster["extra"]["remote_python"],
               **with_pythonpath(kwargs["environment"], ship(hook, layout))}
        result, log = _run_job(hook, {**kwargs, "environment": env})
        assert result is not None and result["ok"], log[-2000:]
        shutil.rmtree(layout.tokenizer)
        result, log = _run_job(hook, {**kwargs, "environment": env})
        assert result is not None and not result["ok"], log[-2000:]
        assert f"tokenizer_model: no directory {layout.tokenizer}" in result["error"]
    finally:
        shutil.rmtree(root, ignore_errors=True)

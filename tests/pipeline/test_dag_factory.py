"""The DAG factory: one DAG per campaign YAML, its shape, and bad YAML as an import error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _dagbag(folder: Path):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(str(folder))


@pytest.fixture(scope="module")
def bag():
    return _dagbag(REPO / "dags")


def test_every_campaign_yaml_becomes_one_dag(bag) -> None:
    """One campaign DAG per YAML, and its evaluation DAG when it evaluates its checkpoints."""
    from operators.campaign.dag.eval_dag import eval_dag_id
    from operators.campaign.schema.load import load_campaign

    assert not bag.import_errors
    campaigns = [load_campaign(p) for p in sorted((REPO / "dags" / "campaigns").glob("*.yaml"))]
    expected = {f"pretrain__{c.name}" for c in campaigns} | {
        eval_dag_id(c) for c in campaigns if c.health.evaluate_checkpoints}
    assert "pretrain__demo__eval" in expected  # demo.yaml turns it on
    assert sorted(bag.dag_ids) == sorted(expected)


def test_demo_dag_shape(bag) -> None:
    dag = bag.dags["pretrain__demo"]
    assert dag.max_active_runs == 1 and "pretrain" in dag.tags
    assert "tokens" in dag.doc_md.lower()
    assert set(dag.params.keys()) == {"train_iters", "segments_per_run", "skip_data_stage",
                                      "dry_run"}
    order = ["data.check", "data.demo_corpus", "data.ingest", "data.raw_gate", "data.tokenizer",
             "data.tokenize", "data.token_gate", "train.preflight", "train.segment_1",
             "train.segment_2",
             "train.segment_3", "train.segment_4", "finished", "export", "evaluate", "register",
             "completed"]
    assert sorted(t.task_id for t in dag.tasks) == sorted(order)
    for upstream, downstream in zip(order, order[1:], strict=False):
        assert downstream in dag.get_task(upstream).downstream_task_ids, (upstream, downstream)
    token_gate = dag.get_task("data.token_gate")
    assert [a.uri for a in token_gate.outlets] == [
        "file://slurm-local/home/pretrain/pp-campaigns/demo/data/manifest.json"]
    assert dag.get_task("train.segment_1").retries == 2
    # The reference path's own checks decide first; a configuration error is never retried.
    preflight = dag.get_task("train.preflight")
    assert preflight.retries == 0 and preflight.upstream_task_ids == {"data.token_gate"}


def test_production_dag_trains_with_bridge_segments(bag) -> None:
    from operators.campaign.dag.segment import TrainingSegmentOperator

    dag = bag.dags["pretrain__llama31_8b_fp8"]
    assert "bridge" in dag.tags
    segments = [t for t in dag.tasks if isinstance(t, TrainingSegmentOperator)]
    assert segments and all(t.campaign.model.recipe == "llama31_8b" for t in segments)
    assert "data.demo_corpus" not in dag.task_ids and "data.ingest" in dag.task_ids
    preflight = dag.get_task("train.preflight")
    assert preflight.retries == 0 and dag.get_task("train.segment_1").retries == 3
    assert preflight.downstream_task_ids == {"train.segment_1"}


def test_parsing_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    probe = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
             "print(sorted(m for m in ('torch', 'mlflow', 'great_expectations', 'megatron', "
             "'transformers', 'paramiko') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, str(REPO / "dags" /
                          "pretrain_campaigns.py")], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(("yaml_text", "field"), [
    ("training:\n  lr_warmup_iter: 5\n", "training.lr_warmup_iter"),
    ("training:\n  train_iters: -3\n", "training.train_iters"),
    ("cluster:\n  partition: 'gpu; rm -rf ~'\n", "cluster.partition"),
])
def test_invalid_yaml_is_an_import_error_naming_file_and_field(tmp_path, yaml_text, field):
    import yaml

    folder = tmp_path / "dags"
    (folder / "campaigns").mkdir(parents=True)
    for dag_file in ("pretrain_campaigns.py", "pretrain_campaign_errors.py"):
        shutil.copy(REPO / "dags" / dag_file, folder)
    base = yaml.safe_load((REPO / "dags" / "campaigns" / "demo.yaml").read_text())
    for section, values in yaml.safe_load(yaml_text).items():
        base[section] = {**base[section], **values}
    base["name"] = "broken"
    (folder / "campaigns" / "broken.yaml").write_text(yaml.safe_dump(base))
    shutil.copy(REPO / "dags" / "campaigns" / "demo.yaml", folder / "campaigns")
    bag = _dagbag(folder)
    assert list(bag.import_errors) == [str(folder / "pretrain_campaign_errors.py")]
    message = next(iter(bag.import_errors.values()))
    assert "campaigns/broken.yaml:" in message and field in message
    # The valid campaign beside it stays, with its evaluation DAG.
    assert sorted(bag.dag_ids) == ["pretrain__demo", "pretrain__demo__eval"]

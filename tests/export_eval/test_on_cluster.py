"""Export, held-out evaluation and registration on the local Slurm cluster, as the DAG runs them.

The export and evaluate commands are the campaign DAG's own (operators/campaign/render/stages.py),
submitted with sbatch over the real sshd and run by the cluster's job venv. The campaign is
the tiny model of conftest.py, trained on the synthetic prefix with split 90,10,0: training
drew only from documents [0, 270), so evaluation must score exactly [270, 300), as
megatron-core's GPTDataset splits them. Registration runs in a process that cannot see the
cluster user's files at all (an empty tmpfs over that home, in its own mount namespace): it
gets the export over SFTP or not at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from operators.campaign.render import stages
from tests.export_eval.cluster_site import HOME, MLFLOW_CONN, USER
from tests.support import cluster
from tests.support.export import TRAIN_ITERS

pytestmark = pytest.mark.cluster


def megatron_splits(trained, tmp_path) -> tuple[list[int], list[int], set[int]]:
    """(train documents, valid documents, documents the valid GPTDataset's samples use), as
    the reference trainer builds them: megatron-core's GPTDataset and builder."""
    from jobscripts.trainer_config import from_dict
    from jobscripts.trainer_data import build_datasets, load_tokenizer

    config = from_dict({**trained.config, "eval_interval": 4, "eval_iters": 1,
                        "data_cache_path": str(tmp_path / "cache")})
    train, valid = build_datasets(config, load_tokenizer(config))
    return (train.indices.tolist(), valid.indices.tolist(),
            {int(d) for d in valid.document_index})


def test_evaluation_scores_exactly_the_documents_training_never_saw(site, evaluations, trained,
                                                                     tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    after, before = evaluations
    assert after["ok"] and before["ok"], (after, before)
    train_docs, valid_docs, sampled = megatron_splits(trained, tmp_path)
    assert valid_docs == list(range(270, 300)) and not set(train_docs) & set(valid_docs)
    assert sampled <= set(valid_docs)
    heldout = after["heldout"]
    assert heldout["split"] == "valid" and heldout["split_weights"] == "90,10,0"
    assert heldout["datasets"] == [{
        "prefix": site.dataset, "split": "valid", "documents": 300,
        "split_range": [valid_docs[0], valid_docs[-1] + 1], "split_documents": len(valid_docs),
        "evaluated_documents": len(valid_docs),
        "evaluated_range": [valid_docs[0], valid_docs[-1] + 1]}]
    assert len(valid_docs) < stages.EVAL_DOCUMENTS  # the whole split, not a sample of it
    # What was scored is those documents' token ids (their EOD aside) and decoded bytes.
    dataset = IndexedDataset(str(trained.dataset))
    documents = [dataset[i].tolist() for i in valid_docs]
    decode = AutoTokenizer.from_pretrained(trained.tokenizer).decode
    assert after["documents_evaluated"] == len(documents)
    assert after["tokens_evaluated"] == sum(len(d) - 1 for d in documents)
    assert after["bytes_evaluated"] == sum(len(decode(d[:-1]).encode()) for d in documents)
    assert before["heldout"] == heldout and before["tokens_evaluated"] == after["tokens_evaluated"]


def test_heldout_perplexity_is_finite_and_below_the_untrained_models(evaluations):
    after, before = evaluations
    for result in (after, before):
        assert math.isfinite(result["perplexity"]) and math.isfinite(result["bits_per_byte"])
    assert before["perplexity"] == pytest.approx(256, rel=0.1)  # ~uniform over the vocabulary
    assert after["perplexity"] < 0.5 * before["perplexity"]
    assert after["bits_per_byte"] < before["bits_per_byte"]
    assert {s["temperature"] for s in after["samples"]} == {0.0, 0.8}


def sha256_on_cluster(path: str) -> str:
    return cluster.remote(f"sha256sum {shlex.quote(path)}").split()[0]


def register_in_namespace(site, mlflow_server, evaluation: dict, tmp_path) -> dict:
    """tracking.register in a child whose view of the cluster user's home is an empty tmpfs."""
    env = {**os.environ, **cluster.connection_env(),
           f"AIRFLOW_CONN_{MLFLOW_CONN.upper()}": mlflow_server.airflow_conn_json(),
           "PP_TRACKING_SPOOL": str(tmp_path / "spool"), "AIRFLOW_HOME": str(tmp_path)}
    args = json.dumps({"campaign": site.campaign, "iteration": TRAIN_ITERS,
                       "evaluation": evaluation})
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs tmpfs {HOME} && exec "$@"', "sh",
         sys.executable, "-m", "tests.export_eval.register_child", args],
        env=env, cwd=cluster.REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_registration_fetches_the_export_over_sftp(site, cluster_export, evaluations,
                                                   mlflow_client, s3_server, mlflow_server,
                                                   tmp_path):
    from operators.tracking.registry import CANDIDATE_ALIAS

    evaluation = evaluations[0]
    registered = register_in_namespace(site, mlflow_server, evaluation, tmp_path)
    name = "pretrain-export_eval_test"
    assert registered["name"] == name and registered["created"]
    version = mlflow_client.get_model_version_by_alias(name, CANDIDATE_ALIAS)
    assert version.version == registered["version"] and version.run_id == registered["run_id"]
    assert version.tags["export_dir"] == site.layout.hf_export  # the cluster's path
    assert version.tags["checkpoint_iteration"] == str(TRAIN_ITERS)
    assert version.tags["eval.heldout_split"] == "valid"
    assert float(version.tags["eval.eval_perplexity"]) == pytest.approx(evaluation["perplexity"],
                                                                        rel=1e-5)
    # Exactly the export's files, byte for byte, and nothing of the checkpoint.
    files = cluster_export["files"]
    assert dict(mlflow_client.artifact_files(version.run_id)) == {
        f"model/{n}": size for n, size in files.items()}
    root = mlflow_client.artifact_root(version.run_id)
    bucket, key = root.removeprefix("s3://").split("/", 1)
    body = s3_server.client().get_object(Bucket=bucket, Key=f"{key}/model/model.safetensors")
    assert hashlib.sha256(body["Body"].read()).hexdigest() == sha256_on_cluster(
        f"{site.layout.hf_export}/model.safetensors")
    # The campaign's run id went back to the cluster through the hook too.
    assert cluster.remote(f"cat {site.layout.mlflow_run_id}").strip() == \
        mlflow_client.get_run(version.run_id).data.tags["mlflow.parentRunId"]

    again = register_in_namespace(site, mlflow_server, evaluation, tmp_path)  # a task retry
    assert (again["version"], again["created"]) == (registered["version"], False)


@pytest.mark.parametrize("change, message", [
    ({"iteration": TRAIN_ITERS // 2}, f"export is of iteration {TRAIN_ITERS // 2}, not "
                                      f"{TRAIN_ITERS}"),
    ({"files": {"config.json": "+1"}}, "config.json: {n} bytes, the export's listing says"),
    ({"files": {"config.json": "-1"}}, "config.json is longer than the"),
    ({"files": {"trainer_state.pt": 10}}, "'trainer_state.pt' is not a file of a Hugging Face"),
    ({"ok": False, "error": "boom"}, "the last export failed: boom"),
])
def test_a_listing_that_does_not_match_the_export_is_refused(site, cluster_export, change,
                                                             message, monkeypatch):
    """A copy of the export with an edited listing, read over SFTP as registration reads it."""
    from operators.campaign.adapters.export_fetch import ClusterExport, ExportFetchError
    from operators.slurm.hook import SlurmHook

    for key, value in cluster.connection_env().items():
        monkeypatch.setenv(key, value)
    copy = site.base / f"bad-{uuid.uuid4().hex[:6]}" / "hf"
    shutil.copytree(site.layout.hf_export, copy)
    listing = json.loads(Path(f"{site.layout.hf_export}.export.json").read_text())
    size = listing["files"]["config.json"]
    for key, value in change.items():
        if key == "files":
            value = {**listing["files"], **{n: size + int(v) if isinstance(v, str) else v
                                            for n, v in value.items()}}
        listing[key] = value
    Path(f"{copy}.export.json").write_text(json.dumps(listing))
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(copy.parent)], check=True)
    export = ClusterExport(SlurmHook(cluster.CONN_ID), str(copy), TRAIN_ITERS)
    with pytest.raises(ExportFetchError, match=re.escape(message.format(n=size))), \
            export.local_copy():
        pass

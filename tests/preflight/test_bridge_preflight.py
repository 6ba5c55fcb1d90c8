"""``train.preflight`` with Megatron Bridge's real config code, as Slurm jobs on the local cluster.

The production campaign (dags/campaigns/llama31_8b_fp8.yaml: Llama 3.1 8B, FP8, 2 nodes x 4
GPUs, world size 8) with only what the local cluster needs changed: its connection, the
cluster user's directories for data, tokenizer, checkpoints and HF_HOME (which holds Llama 3.1
8B's config.json only), and PATH naming the test-only ``apptainer`` stand-in, which runs the
job's command in the Bridge venv (docker/bridge_venv.sh: Bridge 0.6.2 on Python 3.12). The
jobs import the ``jobscripts`` the campaign shipped (operators/campaign/adapters/code_ship.py),
not an installed copy. Bridge's import takes about a minute here: the bad configurations share one
job (the same ``main`` the preflight job runs, once per case), the DAG case fails before it.
"""

from __future__ import annotations

import json
import posixpath
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from operators.campaign.adapters.code_ship import ship
from operators.campaign.dag.preflight import bridge_preflight_job
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.schema.load import load_campaign
from operators.slurm.hook import SlurmHook
from operators.slurm.jobkey import job_key
from operators.slurm.operator import build_spec
from operators.slurm.states import classify
from tests.support import cluster, production_site
from tests.support.airflow import dags_test

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
ROOT = Path("/home/pretrain/pp-test-preflight")  # the cluster user's, on this machine
PREFIX = ROOT / "data" / "fineweb_text_document"
NAME = "preflight_llama31"
DAG_ID = f"pretrain__{NAME}_noblend"
BRIDGE_IMPORT_S = 600  # a Slurm job that imports Bridge on this 2-core machine


def _local_production(name: str, prefix: Path, hf_home: Path = ROOT / "hf_home") -> dict:
    doc = yaml.safe_load((REPO / "dags" / "campaigns" / "llama31_8b_fp8.yaml").read_text())
    doc["name"] = name
    c = doc["cluster"]
    for key in ("partition", "cpus_per_task", "exclusive"):
        c.pop(key, None)
    c.update(ssh_conn_id=cluster.CONN_ID, remote_root=str(ROOT / "campaigns"))
    # No environment modules and no site wrapper here; the HF cache is a host path.
    for key in ("setup",):
        c.pop(key, None)
    c["container"].pop("entrypoint", None)
    # The stand-in checks, as Apptainer does, that the image and every bind source exist.
    c["container"].update(image=str(ROOT / "nemo.sif"), binds=[str(ROOT)])
    # HF_HOME where the campaign sets it: the container's environment, or the cluster's.
    inside = c["container"] if "environment" in c["container"] else c
    inside["environment"] = {**inside.get("environment", {}), "HF_HOME": str(hf_home)}
    c["environment"] = {**c.get("environment", {}),
                        "PATH": f"{ROOT / 'bin'}:/usr/local/bin:/usr/bin:/bin"}
    doc["data"].pop("source", None)
    doc["data"]["blend"] = [{"weight": 1.0, "prefix": str(prefix)}]
    doc["data"]["tokenizer"] = {"path": str(ROOT / "tokenizer")}
    doc["tracking"] = {"enabled": False}
    return doc


def _campaign(tmp_path: Path, name: str = NAME, prefix: Path = PREFIX, **changes):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_local_production(name, prefix, **changes), sort_keys=False))
    return load_campaign(path)


@pytest.fixture(scope="module")
def cluster_files(local_cluster) -> Path:
    production_site.lay_out(ROOT, PREFIX)
    (ROOT / "empty_hf_home").mkdir()
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(ROOT)], check=True)
    yield ROOT
    shutil.rmtree(ROOT, ignore_errors=True)


@pytest.fixture(scope="module")
def hook(cluster_files) -> SlurmHook:
    mp = pytest.MonkeyPatch()
    for name, value in cluster.connection_env().items():
        mp.setenv(name, value)
    yield SlurmHook(cluster.CONN_ID)
    mp.undo()


def _run_job(hook: SlurmHook, kwargs: dict, extra_files: dict | None = None) -> tuple[dict, str]:
    """Submit the rendered preflight job; (its result JSON, its log) once it ended."""
    key = job_key("preflight-test", uuid.uuid4().hex, "train.preflight")
    run_dir = hook.run_dir(key)
    spec = build_spec(key, run_dir, kwargs["command"], kwargs["job"], kwargs["environment"])
    job_id = hook.submit(spec, run_dir, {**kwargs["files"], **(extra_files or {})})

    def ended():
        record = hook.describe(job_id)
        return record if record and record.source == "sacct" and \
            classify(record.state).terminal else None

    cluster.wait_for(ended, BRIDGE_IMPORT_S, f"preflight job {job_id}", interval=3)
    log = hook.read_bytes(posixpath.join(run_dir, f"slurm-{job_id}.out")).decode()
    return hook.read_json(posixpath.join(run_dir, kwargs["result_file"])), log


def _rendered(hook: SlurmHook, campaign) -> tuple[dict, str]:
    layout = Layout.for_campaign(campaign)
    code_dir = ship(hook, layout)
    inputs = RunInputs(tokenizer_dir=str(ROOT / "tokenizer"), code_dir=code_dir)
    return bridge_preflight_job(campaign, layout, inputs, []).to_json(), code_dir


def test_production_campaign_passes_preflight_with_bridges_own_checks(hook, tmp_path):
    campaign = _campaign(tmp_path)
    kwargs, code_dir = _rendered(hook, campaign)
    assert "python3 -m jobscripts.bridge_preflight" in kwargs["command"]
    result, log = _run_job(hook, kwargs)
    assert result["ok"], (result, log[-3000:])
    by = {c["check"]: c["by"] for c in result["checks"]}
    assert by["model.recipe llama31_8b"] == "bridge"  # HF config read offline from HF_HOME
    assert by["bridge.yaml keys"] == "bridge" and by["validate"] == "bridge"
    assert by["mixed_precision.fp8_recipe"] == "preflight"
    validate = next(c for c in result["checks"] if c["check"] == "validate")
    assert "world size 8: TP x PP x CP = 1 x 1 x 2, data-parallel 4" in validate["detail"]
    assert result["not_checked"]  # says what a CPU node could not check
    # The Bridge venv has no copy of the project: the job ran the code the campaign shipped.
    assert f"export PYTHONPATH={code_dir}" in kwargs["command"]
    print(f"preflight job: {result['seconds']} s")


def test_recipe_model_config_missing_from_hf_home_fails_before_any_gpu_job(hook, tmp_path):
    """Issue 12.4: offline, the recipe's HF config must be in HF_HOME; preflight says so."""
    campaign = _campaign(tmp_path, hf_home=ROOT / "empty_hf_home")
    kwargs, _ = _rendered(hook, campaign)
    result, log = _run_job(hook, kwargs)
    assert result is not None and result["ok"] is False, log[-3000:]
    assert result["failed_check"] == "model.recipe llama31_8b"
    error = result["error"]
    assert "the recipe could not load its Hugging Face model config" in error, error
    assert f"HF_HOME={ROOT / 'empty_hf_home'}, HF_HUB_OFFLINE=1" in error
    assert "meta-llama/Meta-Llama-3.1-8B" in error


CASES = {
    # name: (edit of the rendered YAML, what the error must name)
    "typo": (lambda y: y.replace("  train_iters:", "  trian_iters:"), "train.trian_iters"),
    "bad_mixed_precision": (lambda y: y.replace(
        "mixed_precision: bf16_with_fp8_current_scaling_mixed",
        "mixed_precision: bf16_with_fp8_curent_scaling_mixed"),
        "mixed_precision: Unknown mixed-precision recipe 'bf16_with_fp8_curent_scaling_mixed'"),
    "bad_fp8_recipe": (lambda y: y.replace(
        "mixed_precision: bf16_with_fp8_current_scaling_mixed",
        "mixed_precision:\n"
        "  _target_: megatron.bridge.training.mixed_precision.MixedPrecisionConfig\n"
        "  bf16: true\n  params_dtype: bfloat16\n  fp8: hybrid\n  fp8_recipe: tensorwize"),
        "mixed_precision.fp8_recipe: 'tensorwize' is not a Megatron Core FP8 recipe"),
    "layout_does_not_fit": (lambda y: y.replace("context_parallel_size: 2",
                                                "context_parallel_size: 3"),
                            "world size (8) is not divisible by total_model_size"),
}
DRIVER = """import json, sys
from jobscripts import bridge_preflight
for name in sys.argv[1:]:
    bridge_preflight.main(["--recipe", "llama31_8b", "--config-file", name + ".yaml",
                           "--world-size", "8", "--result", name + ".json"])
json.dump({n: json.load(open(n + ".json")) for n in sys.argv[1:]}, open("cases.json", "w"))
"""


def test_bad_configurations_fail_preflight_naming_the_key(hook, tmp_path):
    campaign = _campaign(tmp_path)
    kwargs, _ = _rendered(hook, campaign)
    good = kwargs["files"]["bridge.yaml"]
    files = {"driver.py": DRIVER}
    for name, (edit, _) in CASES.items():
        files[f"{name}.yaml"] = edit(good)
        assert files[f"{name}.yaml"] != good, name
    # The same job, in the same image, with the driver in place of the single run.
    single = ("-m jobscripts.bridge_preflight --recipe llama31_8b --config-file bridge.yaml "
              "--world-size 8 --result result.json")
    assert kwargs["command"].count(single) == 1, kwargs["command"]
    command = kwargs["command"].replace(single, "driver.py " + " ".join(CASES))
    result, log = _run_job(hook, {**kwargs, "command": command, "result_file": "cases.json"},
                           files)
    assert result is not None, log[-3000:]
    for name, (_, named) in CASES.items():
        assert result[name]["ok"] is False, (name, result[name])
        assert named in result[name]["error"], (name, result[name]["error"])
    assert result["layout_does_not_fit"]["error"].startswith(
        "model.tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size")
    assert result["typo"]["failed_check"] == "typo.yaml keys"  # strict merge, not a later check


@pytest.fixture
def noblend_dags(cluster_files, dags_test_env, tmp_path) -> dict[str, str]:
    dags = tmp_path / "dags"
    (dags / "campaigns").mkdir(parents=True)
    (dags / "preflight_campaigns.py").write_text(
        '"""Airflow DAGs of the preflight test campaigns."""\n\nfrom pathlib import Path\n\n'
        "from operators.campaign.dag.dag_factory import build_all\n\n"
        'build_all(Path(__file__).parent / "campaigns", globals())\n')
    doc = _local_production(f"{NAME}_noblend", ROOT / "data" / "absent_text_document")
    (dags / "campaigns" / f"{NAME}_noblend.yaml").write_text(yaml.safe_dump(doc))
    return {**dags_test_env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}


def test_missing_blend_prefix_fails_the_dag_at_preflight_and_nothing_trains(noblend_dags):
    import re

    proc = dags_test(noblend_dags, DAG_ID, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    run_id = re.search(r"creating dag run .* run_id=(\S+)", out).group(1)
    (preflight_job,) = cluster.sacct_by_name(job_key(DAG_ID, run_id, "train.preflight"))
    assert preflight_job["state"] == "FAILED"
    missing = ROOT / "data" / "absent_text_document"
    assert f"preflight: this configuration will not run, nothing submitted: dataset.data_path: " \
           f"missing {missing}.bin" in out, out[-4000:]
    assert not cluster.sacct_by_name(job_key(DAG_ID, run_id, "train.segment_1", -1, 1))
    runs = Path(cluster.connection()["extra"]["remote_work_dir"])
    result = json.loads((runs / preflight_job["name"] / "result.json").read_text())
    assert result["failed_check"] == "paths" and result["ok"] is False

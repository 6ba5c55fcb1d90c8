"""The export/evaluate site on the local cluster, shared by the modules that use it.

One copy of the session's tiny trained model (tests/export_eval/conftest.py) on the cluster
user's disk, as a campaign laid out by operators/campaign/render/layout.py; the DAG's own export and
evaluate stage commands run there with sbatch (``run_stage``), as SlurmJobOperator runs them.
The fixtures are package-scoped (imported by conftest.py): the export and the two
evaluations run once for test_on_cluster.py and test_vllm_on_cluster.py together.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from operators.campaign.render import stages
from operators.campaign.render.layout import Layout
from operators.campaign.schema.load import campaign_from_dict
from tests.campaign.util import DELETE, edited, raw
from tests.support import cluster
from tests.support.export import TRAIN_ITERS

LOGPROBS_FILE = "logprobs.json"  # the trained evaluation's per-token log-probs (cross-check)

USER = "pretrain"
HOME = Path("/home/pretrain")
ROOT = HOME / "pp-test-export-eval"
CI_CAMPAIGN = cluster.REPO / "tests" / "campaigns" / "ci_campaign.yaml"
MLFLOW_CONN = "mlflow_export_eval"
SBATCH_FLAGS = {"partition": "--partition", "account": "--account", "qos": "--qos",
                "time": "--time", "cpus_per_task": "--cpus-per-task", "mem": "--mem"}


@dataclass
class Site:
    base: Path  # everything of this module on the cluster's disk
    campaign: dict  # the campaign document
    layout: Layout
    dataset: str  # the trained-on prefix, as the cluster sees it
    untrained: str  # HF directory of the model before training


def campaign_document(base: Path, dataset: str, trained) -> dict:
    return edited(raw(CI_CAMPAIGN), {
        "name": "export_eval_test", "cluster.remote_root": str(base), "cluster.time_limit": "10",
        "cluster.mem": "3G", "data.source": DELETE, "data.prefixes": [dataset],
        "data.split": trained.split,
        "data.tokenizer": {"path": str(base / "export_eval_test" / "data" / "tokenizer")},
        "training.seq_length": trained.seq_length,
        "tracking": {"enabled": True, "mlflow_conn_id": MLFLOW_CONN,
                     "experiment": f"export-eval-{base.name}"}})


@pytest.fixture(scope="package")
def site(local_cluster, trained) -> Site:
    base = ROOT / uuid.uuid4().hex[:10]
    dataset = base / "data" / "synthetic_text_document"
    doc = campaign_document(base, str(dataset), trained)
    layout = Layout.for_campaign(campaign_from_dict(doc))
    try:
        shutil.copytree(trained.root, layout.checkpoints)
        shutil.copytree(trained.tokenizer, layout.tokenizer)
        shutil.copytree(trained.untrained, base / "untrained")
        dataset.parent.mkdir()
        for suffix in (".bin", ".idx"):
            shutil.copy(f"{trained.dataset}{suffix}", f"{dataset}{suffix}")
        subprocess.run(["chown", "-R", f"{USER}:{USER}", str(ROOT)], check=True)
        yield Site(base, doc, layout, str(dataset), str(base / "untrained"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_stage(stage: dict, run_dir: Path, expect_ok: bool = True) -> dict:
    """The stage's command as a Slurm job in ``run_dir``, as SlurmJobOperator runs it: the
    cluster's Python in ``$PP_PYTHON``, the stage's sbatch options. Returns its result JSON
    (with ``expect_ok=False``: also of a job that failed, which must have failed)."""
    cluster.remote(f"mkdir -p {shlex.quote(str(run_dir))}")
    python = cluster.connection()["extra"]["remote_python"]
    flags = " ".join(f"{SBATCH_FLAGS[k]}={shlex.quote(str(v))}" for k, v in stage["job"].items())
    command = (f"cd {shlex.quote(str(run_dir))} && sbatch --wait --parsable {flags} "
               f"--output=slurm-%j.out --export=ALL,PP_PYTHON={shlex.quote(python)} "
               f"--wrap={shlex.quote(stage['command'])}")
    if not expect_ok:  # sbatch --wait's own exit code is not always the job's: ask sacct
        job_id = cluster.remote(f"{command} || true").split()[0].split(";")[0]
        assert job_state(job_id) == "FAILED", f"job {job_id} in {run_dir} did not fail"
        return json.loads((run_dir / stage["result_file"]).read_text())
    try:
        cluster.remote(command)
    except subprocess.CalledProcessError as exc:
        logs = "".join(p.read_text(errors="replace")[-4000:] for p in run_dir.glob("slurm-*.out"))
        raise AssertionError(f"job failed (rc {exc.returncode}): {exc.stderr}\n{logs}") from exc
    return json.loads((run_dir / stage["result_file"]).read_text())


def job_state(job_id: str) -> str:
    """The job's final state in Slurm's accounting (slurmdbd may lag a moment behind)."""
    for _ in range(30):
        state = cluster.remote(f"sacct -j {shlex.quote(job_id)} -X -n -P -o State").strip()
        if state and state not in ("PENDING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(1)
    return state


@pytest.fixture(scope="package")
def cluster_export(site) -> dict:
    campaign = campaign_from_dict(site.campaign)
    result = run_stage(stages.export(campaign, site.layout), site.base / "runs" / "export")
    assert result["ok"] and result["iteration"] == TRAIN_ITERS, result
    return result


@pytest.fixture(scope="package")
def evaluations(site, cluster_export) -> tuple[dict, dict]:
    """(trained, untrained): the evaluate stage's job, and the same job on the model before
    training; both at once (the node has a core for each)."""
    stage = stages.evaluate(campaign_from_dict(site.campaign), site.layout)
    untrained = {**stage, "command": stage["command"].replace(site.layout.hf_export,
                                                              site.untrained)}
    assert untrained["command"] != stage["command"]
    stage = {**stage, "command": f"{stage['command']} --logprobs-out {LOGPROBS_FILE}"}
    with ThreadPoolExecutor(2) as pool:
        after = pool.submit(run_stage, stage, site.base / "runs" / "evaluate")
        before = pool.submit(run_stage, untrained, site.base / "runs" / "evaluate-untrained")
        return after.result(), before.result()

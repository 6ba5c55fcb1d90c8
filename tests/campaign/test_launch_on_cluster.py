"""The production segment's launch chain run for real on the local cluster, as far as CPUs go.

The production campaign with only what this machine needs changed: the ``gpu`` partition
(four GPUs counted by Slurm, no devices), 1 node, 1 GPU per node (so context parallelism 1),
2 CPUs, not exclusive, the cluster user's paths (binds with the same path inside: the
``apptainer`` stand-in, tests/support/standins/apptainer, cannot mount), a ``module`` and an
entrypoint stand-in that log their calls, and ``BRIDGE_CONFIG_ONLY=1``. The rendered script
(bridge_segment, as the segment task renders it) is submitted with sbatch; in it the set-up
lines run, srun --mpi=pmi2 --cpus-per-task starts the stand-in, which runs the entrypoint,
which runs the inner shell (container environment, PYTHONPATH to the shipped jobscripts), which
execs torchrun (the Bridge venv's), whose rendezvous starts jobscripts.bridge_pretrain, which
builds Bridge's config from the YAML and stops before pretrain(). Before the sbatch an old
segment.json lies in the run dir: the operator must clear it.
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
from operators.campaign.render import bridge
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.schema.load import load_campaign
from operators.slurm.hook import SlurmHook
from operators.slurm.jobkey import job_key
from operators.slurm.operator import SlurmJobOperator, build_spec
from operators.slurm.states import classify
from tests.support import cluster, production_site

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
ROOT = Path("/home/pretrain/pp-test-launch")
PREFIX = ROOT / "data" / "corpus_text_document"
BRIDGE_IMPORT_S = 600  # one Bridge import in a Slurm job on this 2-core machine
ENTRYPOINT = """#!/bin/bash
echo "[entrypoint stand-in] $*" >&2
exec "$@"
"""
MODULE = """#!/bin/bash
echo "[module stand-in] $*" >&2
"""


def _campaign(tmp_path: Path):
    doc = yaml.safe_load((REPO / "dags" / "campaigns" / "llama31_8b_fp8.yaml").read_text())
    doc["name"] = "launch_llama31"
    c = doc["cluster"]
    c.pop("exclusive")
    c.update(ssh_conn_id=cluster.CONN_ID, remote_root=str(ROOT / "campaigns"), partition="gpu",
             nodes=1, gpus_per_node=1, cpus_per_task=2, time_limit="00:30:00")
    c["container"].update(image=str(ROOT / "nemo.sif"), entrypoint=str(ROOT / "bin/adapt.sh"),
                          binds=[str(ROOT), f"{ROOT / 'hf_home'}:{ROOT / 'hf_home'}"],
                          environment={"HF_HOME": str(ROOT / "hf_home")})
    c["environment"] = {**c["environment"], "BRIDGE_CONFIG_ONLY": "1",
                        "PATH": f"{ROOT / 'bin'}:/usr/local/bin:/usr/bin:/bin"}
    doc["training"]["context_parallel_size"] = 1
    doc["data"].pop("source")
    doc["data"]["prefixes"] = [str(PREFIX)]
    doc["data"]["tokenizer"] = {"path": str(ROOT / "tokenizer")}
    doc["tracking"] = {"enabled": False}
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_campaign(path)


@pytest.fixture(scope="module")
def hook(local_cluster):
    production_site.lay_out(ROOT, PREFIX)
    (ROOT / "bin" / "adapt.sh").write_text(ENTRYPOINT)
    (ROOT / "bin" / "module").write_text(MODULE)
    for name in ("adapt.sh", "module"):
        (ROOT / "bin" / name).chmod(0o755)
    subprocess.run(["chown", "-R", "pretrain:pretrain", str(ROOT)], check=True)
    mp = pytest.MonkeyPatch()
    for name, value in cluster.connection_env().items():
        mp.setenv(name, value)
    yield SlurmHook(cluster.CONN_ID)
    mp.undo()
    shutil.rmtree(ROOT, ignore_errors=True)


def test_rendered_segment_runs_through_srun_container_and_torchrun(hook, tmp_path) -> None:
    campaign = _campaign(tmp_path)
    layout = Layout.for_campaign(campaign)
    code_dir = ship(hook, layout)
    inputs = RunInputs.of([str(PREFIX)], code_dir=code_dir)
    seg = bridge.bridge_segment(campaign, layout, inputs, [], train_iters=600).to_json()
    key = job_key("launch-test", uuid.uuid4().hex, "train.segment_1")
    run_dir = hook.run_dir(key)
    hook.upload(run_dir, {"segment.json": json.dumps({"end_iteration": 999})})  # a stale try
    op = SlurmJobOperator(task_id="train.segment_1", ssh_conn_id=cluster.CONN_ID,
                          command=seg["command"], job=seg["job"],
                          environment=seg["environment"], files=seg["files"],
                          result_file="segment.json")
    env = {"PP_PYTHON": "/opt/pretrain-pipeline/venv/bin/python", **seg["environment"]}
    spec = build_spec(key, run_dir, seg["command"], seg["job"], env)
    record = op._attach_or_submit(spec, run_dir, key, seg["files"])
    assert hook.read_json(posixpath.join(run_dir, "segment.json")) is None  # 12: cleared

    def ended():
        found = hook.describe(record.job_id)
        return found if found and found.source == "sacct" and classify(found.state).terminal \
            else None

    final = cluster.wait_for(ended, BRIDGE_IMPORT_S, f"segment job {record.job_id}", interval=3)
    log = hook.read_bytes(posixpath.join(run_dir, f"slurm-{record.job_id}.out")).decode()
    result = hook.read_json(posixpath.join(run_dir, "segment.json"))
    assert final.state == "COMPLETED", log[-4000:]
    # 3: the set-up lines, then the stand-in, then the site's entrypoint, in that order.
    order = [log.index(s) for s in ("[module stand-in] load brics/nccl",
                                    "[module stand-in] load brics/apptainer-multi-node",
                                    "[apptainer stand-in] run image=",
                                    "[entrypoint stand-in] bash")]
    assert order == sorted(order), log[-4000:]
    assert f"binds={ROOT} {ROOT / 'hf_home'}:{ROOT / 'hf_home'}" in log
    # 5: the container's environment exported inside it only, the host's in the batch shell.
    assert f"export HF_HOME={ROOT / 'hf_home'}; export HF_HUB_OFFLINE=1" in log
    script = hook.read_bytes(posixpath.join(run_dir, "job.sbatch")).decode()
    assert "export HF_HOME" not in script.split("\nsrun ", 1)[0]
    assert "export NCCL_DEBUG=WARN" in script.split("\nsrun ", 1)[0]
    # torchrun's rendezvous and Bridge's config, built from the shipped jobscripts.
    assert "config built, pretrain() not called" in log, log[-4000:]
    assert result["preflight"] == {"config_built": True, "train_iters": 600, "world_size": "1"}
    assert result["error"] is None and result["startup_seconds"] > 0

"""The per-checkpoint evaluation's two jobs (operators/campaign/render/checkpoint_eval.py,
jobscripts/checkpoint_eval.py) as Slurm jobs on the local cluster, on the session's tiny
trained model (checkpoints 12 and 24) laid out as a campaign (cluster_site.py), with the
DAG's shipped code on PYTHONPATH as the evaluation DAG's tasks run them: each checkpoint
exported and scored on the held-out split; one that retention removed is skipped, said so."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from operators.campaign.adapters.code_ship import ship
from operators.campaign.render import checkpoint_eval
from operators.campaign.schema.load import campaign_from_dict
from operators.slurm.hook import SlurmHook
from tests.export_eval.cluster_site import run_stage
from tests.support import cluster
from tests.support.export import TRAIN_ITERS

pytestmark = pytest.mark.cluster
CHECKPOINTS = [TRAIN_ITERS // 2, TRAIN_ITERS]
GONE = 6  # no such checkpoint: removed by retention, as far as the job can tell


@pytest.fixture(scope="module")
def jobs(site):
    mp = pytest.MonkeyPatch()
    for name, value in cluster.connection_env().items():
        mp.setenv(name, value)
    try:
        code_dir = ship(SlurmHook(cluster.CONN_ID), site.layout)
    finally:
        mp.undo()
    campaign = campaign_from_dict(site.campaign)

    def run(request, name: str) -> dict:
        stage = {"job": dict(request.job), "result_file": request.result_file,
                 "command": f"export PYTHONPATH={shlex.quote(code_dir)}\n{request.command}"}
        return run_stage(stage, site.base / "runs" / name)

    exported = run(checkpoint_eval.export_request(campaign, site.layout, [GONE, *CHECKPOINTS]),
                   "checkpoint-export")
    evaluated = run(checkpoint_eval.evaluate_request(campaign, site.layout, CHECKPOINTS,
                                                     "transformers"), "checkpoint-evaluate")
    return exported, evaluated


def test_each_checkpoint_is_exported_and_a_removed_one_skipped(jobs, site) -> None:
    exported, _ = jobs
    assert exported["ok"] and exported["skipped"] == [GONE], exported
    assert sorted(int(i) for i in exported["checkpoints"]) == CHECKPOINTS
    for i in CHECKPOINTS:
        assert exported["checkpoints"][str(i)]["iteration"] == i
        assert (Path(checkpoint_eval.evals_dir(site.layout)) / f"iter_{i:07d}" / "hf"
                / "config.json").is_file()


def test_each_checkpoint_is_scored_on_the_heldout_split(jobs, site) -> None:
    _, evaluated = jobs
    assert evaluated["ok"], evaluated
    scores = {int(i): r for i, r in evaluated["checkpoints"].items()}
    assert sorted(scores) == CHECKPOINTS
    for i, r in scores.items():
        assert r["backend"] == "transformers" and math.isfinite(r["bits_per_byte"])
        assert r["samples"]
        full = json.loads(Path(checkpoint_eval.eval_result_path(site.layout, i)).read_text())
        assert full["bits_per_byte"] == r["bits_per_byte"]
    # the later checkpoint has trained longer on the same chain: it predicts it better
    assert scores[TRAIN_ITERS]["bits_per_byte"] < scores[TRAIN_ITERS // 2]["bits_per_byte"]

"""The production campaign's ``train.preflight`` job, rendered by the project's own functions:
a golden sbatch script, and the properties that make it check what segment 1 will run."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from operators.campaign.dag.preflight import bridge_preflight_job
from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.render import bridge
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.schema.load import load_campaign
from operators.slurm.operator import build_spec
from operators.slurm.render import render_script
from tests.campaign.util import LLAMA_8B

GOLDEN = Path(__file__).parent / "golden" / "preflight.sbatch"
ROOT = "/scratch/pretrain/campaigns/llama31_8b_fp8"
PREFIX = f"{ROOT}/data/corpus_text_document"
CODE = f"{ROOT}/code/0123456789abcdef"


def _rendered():
    campaign = load_campaign(LLAMA_8B)
    layout = Layout.for_campaign(campaign)
    inputs = RunInputs.of([PREFIX], tokenizer_dir=layout.tokenizer, code_dir=CODE)
    job = bridge_preflight_job(campaign, layout, inputs, []).to_json()
    key = "pp-train.preflight-0123456789abcdef"
    script = render_script(build_spec(key, f"/scratch/pretrain/pp-runs/{key}", job["command"],
                                      job["job"], job["environment"]))
    operator = TrainingSegmentOperator(campaign=campaign, segment=1, task_id="train.segment_1")
    segment = operator.render_segment(RunInputs.of([PREFIX], layout.tokenizer), [],
                                      campaign.training.train_iters)
    return campaign, job, script, segment


def test_golden() -> None:
    _, _, script, _ = _rendered()
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(script)
    assert script == GOLDEN.read_text(), "preflight.sbatch changed (UPDATE_GOLDEN=1 rewrites it)"


def test_checks_segment_ones_yaml_in_the_training_image_on_a_cpu() -> None:
    campaign, job, script, segment = _rendered()
    # exactly the YAML segment 1 gets, from the same renderer
    assert job["files"][bridge.CONFIG_FILE] == segment.files[bridge.CONFIG_FILE]
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", script, re.M))
    assert "gpus-per-node" not in directives and "nodes" not in directives
    assert directives["time"] == "00:30:00"
    # the site's set-up on the host, then the training image under its wrapper
    assert "module load brics/apptainer-multi-node" in script
    launch = script.splitlines()[-1]
    assert launch.startswith("apptainer exec --nv --bind /scratch/pretrain --bind "
                             f"/projects/pretrain/hf_home:/hf_home "
                             f"{campaign.cluster.container.image} /host/adapt.sh bash ")
    inner = shlex.split(launch)[-1]
    # inside: the container's environment and the training's offline defaults, then the
    # shipped code first on PYTHONPATH, then the image's own Python
    assert "export HF_HOME=/hf_home" in inner and "export HF_HUB_OFFLINE=1" in inner
    assert f"export PYTHONPATH={CODE}${{PYTHONPATH:+:$PYTHONPATH}}" in inner
    assert inner.endswith("exec python3 -m jobscripts.bridge_preflight --recipe llama31_8b "
                          "--config-file bridge.yaml --world-size 8 --result result.json")

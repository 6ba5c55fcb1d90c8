"""The production path's rendering: golden Bridge YAML and sbatch script for the 8B FP8
campaign, the exit-duration arithmetic, and the job script actually run against stand-ins
for srun, apptainer, scontrol and torchrun."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from operators.campaign.render import bridge
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.render.plan import exit_duration_minutes, signal_lead_seconds
from operators.campaign.schema.load import campaign_from_dict, load_campaign
from operators.slurm.operator import build_spec
from operators.slurm.render import render_script
from tests.campaign.util import DELETE, LLAMA_8B, edited, raw

GOLDEN = Path(__file__).parent / "golden"
KEY = "pp-train_segment_1-0123456789abcdef"
RUN_DIR = "/scratch/pretrain/pp-runs/" + KEY
PREFIX = "/scratch/pretrain/campaigns/llama31_8b_fp8/data/fineweb_sample_text_document"
CODE = "/scratch/pretrain/pretrain-pipeline"


@pytest.fixture(scope="module")
def campaign():
    return load_campaign(LLAMA_8B)


@pytest.fixture(scope="module")
def paths(campaign):
    """The layout and the runtime inputs (the renderers' arguments after the campaign)."""
    return Layout.for_campaign(campaign), RunInputs.of([PREFIX], code_dir=CODE)


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def _script(campaign, paths) -> str:
    seg = bridge.bridge_segment(campaign, *paths)
    return render_script(build_spec(KEY, RUN_DIR, seg.command, seg.job, seg.environment))


def test_golden_bridge_yaml(campaign, paths) -> None:
    _golden("llama31_8b_fp8.bridge.yaml", bridge.render_bridge_yaml(campaign, *paths, 223))


def test_golden_sbatch(campaign, paths) -> None:
    _golden("llama31_8b_fp8.sbatch", _script(campaign, paths))


def test_segment_bundles_yaml_with_the_planned_exit(campaign, paths) -> None:
    seg = bridge.bridge_segment(campaign, *paths)
    # 240 min - start-up before Bridge's timer 3 - save 2 - margin 5
    assert seg.files[bridge.CONFIG_FILE] == bridge.render_bridge_yaml(campaign, *paths, 230)
    assert seg.result_file == "segment.json"
    # A slower save measured by an earlier segment shortens the next one's training.
    slower = bridge.bridge_segment(campaign, *paths, [{"save_seconds": 600.0, "saves": 2}])
    assert "exit_duration_in_mins: 227" in slower.files[bridge.CONFIG_FILE]


def test_yaml_facts(campaign, paths) -> None:
    tree = yaml.safe_load(bridge.render_bridge_yaml(campaign, *paths, 223))
    assert set(tree) == {"dataset", "train", "validation", "optimizer", "scheduler",
                         "checkpoint", "ddp", "model", "tokenizer", "logger", "rng",
                         "mixed_precision"}
    assert tree["mixed_precision"] == "bf16_with_fp8_current_scaling_mixed"
    assert not any("fp8" in key for key in tree["model"])  # FP8 only through mixed_precision
    assert tree["dataset"]["sequence_length"] == tree["model"]["seq_length"] == 8192
    assert tree["checkpoint"]["save"] == tree["checkpoint"]["load"] == (
        "/scratch/pretrain/campaigns/llama31_8b_fp8/checkpoints")
    assert tree["train"]["exit_duration_in_mins"] == 223
    # The recipe's scheduler weight decay would otherwise win over optimizer.weight_decay.
    assert tree["scheduler"]["start_weight_decay"] == tree["scheduler"]["end_weight_decay"] \
        == tree["optimizer"]["weight_decay"] == 0.1
    assert tree["tokenizer"]["tokenizer_model"] == campaign.data.tokenizer.path


def test_blend_prefixes_and_recompute(tmp_path) -> None:
    doc = edited(raw(LLAMA_8B), {
        "data.source": DELETE,
        "data.blend": [{"weight": 0.7, "prefix": "/d/web"}, {"weight": 0.3, "prefix": "/d/code"}],
        "training.recompute": "full", "training.tensor_parallel_size": 2,
        "training.context_parallel_size": 1, "training.lr_decay_style": "WSD",
        "training.lr_wsd_decay_iters": 200, "segments.iters_per_segment": 100})
    c = campaign_from_dict(doc)
    tree = yaml.safe_load(bridge.render_bridge_yaml(c, Layout.for_campaign(c), RunInputs(), 60))
    assert tree["dataset"]["data_path"] == ["0.7", "/d/web", "0.3", "/d/code"]
    assert tree["model"]["recompute_granularity"] == "full"
    assert tree["model"]["sequence_parallel"] is True
    assert tree["scheduler"]["lr_wsd_decay_iters"] == 200
    assert tree["train"]["exit_interval"] == 100


def test_data_and_tokenizer_from_the_data_stage_must_be_passed(campaign) -> None:
    with pytest.raises(ValueError, match="data_prefixes"):
        bridge.render_bridge_yaml(campaign, Layout.for_campaign(campaign), RunInputs(), 60)
    trained = campaign_from_dict(edited(raw(LLAMA_8B), {
        "data.tokenizer": {"train": {"vocab_size": 32000}}}))
    with pytest.raises(ValueError, match="tokenizer_dir"):
        bridge.render_bridge_yaml(trained, Layout.for_campaign(trained),
                                  RunInputs.of(["/p"]), 60)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, None])
def test_exit_duration_must_be_a_positive_int(campaign, paths, bad) -> None:
    with pytest.raises(ValueError, match="exit_duration_in_mins"):
        bridge.render_bridge_yaml(campaign, *paths, bad)


def test_run_paths_are_checked_like_campaign_paths(campaign) -> None:
    with pytest.raises(ValueError, match=r"run_paths.data_prefixes\[0\]"):
        RunInputs.of(["/d/x;rm -rf /"])
    with pytest.raises(ValueError, match="run_paths.code_dir"):
        RunInputs(code_dir="/a/../b")


@pytest.mark.parametrize(("limit", "startup", "save_s", "margin", "expected"), [
    (240, 10, 120, 5, 223),  # the 8B segment: 240 - 10 - 2 - 5
    (240, 10, 121, 5, 222),  # a second more of saving costs a whole minute: round down
    (60, 0, 0, 2, 58),
    (5, 1, 5, 2, 1),  # the demo: one minute of training
    (30.5, 2.25, 30, 1, 26),
])
def test_exit_duration_arithmetic(limit, startup, save_s, margin, expected) -> None:
    assert exit_duration_minutes(limit, startup, save_s, margin) == expected


@pytest.mark.parametrize("args", [(10, 5, 120, 3), (5, 1, 5, 3), (10, -1, 0, 1),
                                  (10, 1, float("nan"), 1), (float("inf"), 1, 1, 1)])
def test_exit_duration_refuses_no_time_or_nonsense(args) -> None:
    with pytest.raises(ValueError):
        exit_duration_minutes(*args)


def test_signal_lead_is_inside_the_margin() -> None:
    assert signal_lead_seconds(5) == 150
    assert signal_lead_seconds(2) == 60
    for margin in (2, 3, 5, 10, 30):
        assert signal_lead_seconds(margin) < margin * 60


def test_job_options(campaign, paths) -> None:
    job, command, env = bridge.bridge_job(campaign, paths[1])
    assert job == {"nodes": 2, "ntasks_per_node": 1, "gpus_per_node": "4", "time": "04:00:00",
                   "exclusive": True, "signal": "TERM@150", "requeue": True, "partition": "workq",
                   "cpus_per_task": 288}
    # The host's environment is cluster.environment alone; the container's (HF_HOME=/hf_home,
    # the Bridge defaults) is exported inside the container, in the inner command.
    assert env == {"NCCL_DEBUG": "WARN"}
    inner = command.rsplit(" bash -c ", 1)[1]
    for export in ("CUDA_DEVICE_MAX_CONNECTIONS=1", "HF_HUB_OFFLINE=1", "HF_HOME=/hf_home"):
        assert f"export {export}" in inner
    assert "srun --mpi=pmi2" in command and "apptainer run --nv" in command


def test_campaign_environment_overrides_the_defaults(campaign, paths) -> None:
    online = campaign_from_dict(edited(raw(LLAMA_8B), {
        "cluster.environment": {"HF_HUB_OFFLINE": "0"}}))
    assert bridge.bridge_job(online, paths[1])[2]["HF_HUB_OFFLINE"] == "0"


def test_reference_model_has_no_bridge_job() -> None:
    from tests.campaign.util import DEMO

    demo = load_campaign(DEMO)
    with pytest.raises(ValueError):
        bridge.bridge_job(demo, RunInputs())
    with pytest.raises(ValueError, match="model.recipe"):
        bridge.render_bridge_yaml(demo, Layout.for_campaign(demo),
                                  RunInputs.of(["/p"], tokenizer_dir="/t"), 5)


_STUBS = {
    # Many lines: a reader that stops after the first would SIGPIPE it (set -o pipefail).
    "scontrol": 'printf "gh001\\ngh002\\n"; seq -f "gh%g" 3 100000',
    # Two nodes: run the step once per node with its own SLURM_NODEID, as srun would.
    "srun": 'echo "srun $*" | grep -o -- "--cpus-per-task=[0-9]*"\n'
            'while [[ $1 == --* ]]; do shift; done\n'
            'for n in 0 1; do SLURM_NODEID=$n "$@"; done',
    "apptainer": 'shift; while [[ $1 == --nv || $1 == --bind ]]; do '
                 '[[ $1 == --bind ]] && shift; shift; done\n'
                 'echo "image=$1 entrypoint=$2"; shift 2; exec "$@"',
    "torchrun": 'echo "PYTHONPATH=$PYTHONPATH CDMC=$CUDA_DEVICE_MAX_CONNECTIONS torchrun $*"',
    "module": 'echo "module $*"',
}


def test_script_runs_one_torchrun_per_node_with_its_rank(campaign, paths, tmp_path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in _STUBS.items():
        (bindir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bindir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(_script(campaign, paths))
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "gh[001-002]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "288"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    runs = [line for line in out.splitlines() if "torchrun" in line]
    assert len(runs) == 2
    for rank, line in enumerate(runs):
        assert f"--node-rank {rank} " in line
        assert "--nnodes 2 --nproc-per-node 4" in line
        assert "--master-addr gh001 --master-port 29500" in line
        assert line.startswith(f"PYTHONPATH={CODE} CDMC=1 torchrun")
        assert line.endswith("-m jobscripts.bridge_pretrain --recipe llama31_8b "
                             "--config-file bridge.yaml --segment-result segment.json "
                             "--keep-last 3 --keep-every 500")
    assert "image=/scratch/pretrain/containers/nemo_26.04.sif entrypoint=/host/adapt.sh" in out
    assert out.index("module load brics/nccl") < out.index("image=")  # site set-up first
    assert "--cpus-per-task=288" in out.splitlines()  # srun is told the job's CPU count

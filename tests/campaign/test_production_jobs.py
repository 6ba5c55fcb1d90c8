"""Every job the production campaign (dags/campaigns/llama31_8b_fp8.yaml) submits, rendered by
the project's own functions into the exact sbatch script: golden files under
golden/production/, and for each the properties issue 12 is about, asserted one by one (a
golden alone would only say "changed").

    data stages   small CPU jobs on the host, no GPU, no container, no container paths
    segment 1     srun CPUs, site set-up, entrypoint, container environment, retention args
    segment 2     resumed: the trigger's train_iters, start-up and save measured by segment 1
    export        in the training image, the recipe's HF model id (not the tokenizer dir)
    evaluate      in the vLLM image on one GPU
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from operators.campaign.dag.segment import TrainingSegmentOperator
from operators.campaign.render import bridge, stages
from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.render.placement import CODE_DIR_VAR, CONTAINER_PYTHONPATH
from operators.campaign.schema.load import campaign_from_dict, load_campaign
from operators.slurm.operator import build_spec
from operators.slurm.render import render_script
from tests.campaign.util import DELETE, LLAMA_8B, edited, raw

GOLDEN = Path(__file__).parent / "golden" / "production"
ROOT = "/scratch/pretrain/campaigns/llama31_8b_fp8"
PREFIX = f"{ROOT}/data/corpus_text_document"
HOST_PYTHON = "/scratch/pretrain/venvs/pp/bin/python"
DATA_STAGES = ("ingest", "raw_gate", "tokenizer", "tokenize", "token_gate")
# What segment 1 measured: 2 min from job start to pretrain(), 90 s per save.
SEGMENT_1 = {"start_iteration": 0, "end_iteration": 250, "startup_seconds": 120.0,
             "save_seconds": 90.0, "saves": 1}


@pytest.fixture(scope="module")
def campaign():
    return load_campaign(LLAMA_8B)


def _script(name: str, kwargs: dict) -> str:
    key = f"pp-{name}-0123456789abcdef"
    env = {"PP_PYTHON": HOST_PYTHON, **kwargs["environment"]}
    return render_script(build_spec(key, f"/scratch/pretrain/pp-runs/{key}", kwargs["command"],
                                    kwargs["job"], env))


def _segment(campaign, history=(), train_iters=None) -> dict:
    """What TrainingSegmentOperator renders before its sbatch (the data from the manifest)."""
    op = TrainingSegmentOperator(campaign=campaign, segment=len(history) + 1,
                                 task_id=f"train.segment_{len(history) + 1}")
    layout = Layout.for_campaign(campaign)
    seg = op.render_segment(RunInputs.of([PREFIX], layout.tokenizer), list(history),
                            train_iters or 1000)
    return {"command": seg.command, "job": seg.job, "environment": seg.environment,
            "files": seg.files}


@pytest.fixture(scope="module")
def jobs(campaign) -> dict[str, dict]:
    layout = Layout.for_campaign(campaign)
    rendered = {name: getattr(stages, name)(campaign, layout) for name in DATA_STAGES
                if name != "token_gate"}
    rendered["token_gate"] = stages.token_gate(campaign, layout, "/runs/ingest/result.json")
    rendered["export"] = stages.export(campaign, layout)
    rendered["evaluate"] = stages.evaluate(campaign, layout)
    from operators.campaign.dag.preflight import bridge_preflight_job

    rendered["preflight"] = bridge_preflight_job(
        campaign, Layout.for_campaign(campaign), RunInputs.of([PREFIX]), []).to_json()
    rendered["segment_1"] = _segment(campaign)
    rendered["segment_2"] = _segment(campaign, [SEGMENT_1], train_iters=600)
    return rendered


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed (UPDATE_GOLDEN=1 rewrites it)"


@pytest.mark.parametrize("name", [*DATA_STAGES, "preflight", "segment_1", "segment_2",
                                  "export", "evaluate"])
def test_golden(jobs, name) -> None:
    _golden(f"{name}.sbatch", _script(name, jobs[name]))
    if name.startswith("segment"):
        _golden(f"{name}.bridge.yaml", jobs[name]["files"][bridge.CONFIG_FILE])


def _directives(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", script, re.M))


# --- 8: each stage's placement --------------------------------------------------------------
@pytest.mark.parametrize("name", DATA_STAGES)
def test_data_stages_are_small_cpu_jobs_on_the_host(jobs, name) -> None:
    script = _script(name, jobs[name])
    d = _directives(script)
    assert "gpus-per-node" not in d and "exclusive" not in d and "nodes" not in d
    # stages.data.cpus_per_task: 8 (tokenize: one CPU per worker), not the segment's 288.
    assert d["cpus-per-task"] == ("32" if name == "tokenize" else "8")
    assert "apptainer exec" not in script and '"$PP_PYTHON" -m jobscripts.' in script
    # 5: container paths never reach a host job.
    assert "HF_HOME" not in script and "/hf_home" not in script.replace(
        "--bind /projects/pretrain/hf_home:/hf_home", "")


def test_default_data_placement_is_four_cpus(campaign) -> None:
    c = campaign_from_dict(edited(raw(LLAMA_8B), {"stages.data": DELETE}))
    job = stages.ingest(c, Layout.for_campaign(c))["job"]
    assert job == {"partition": "workq", "time": "04:00:00", "cpus_per_task": 4}


def test_export_runs_in_the_training_image_on_cpu(jobs, campaign) -> None:
    script = _script("export", jobs["export"])
    d = _directives(script)
    assert "gpus-per-node" not in d and d["time"] == "02:00:00" and d["cpus-per-task"] == "16"
    launch = script.splitlines()[-1]
    assert launch.startswith("apptainer exec --nv --bind /scratch/pretrain "
                             f"--bind /projects/pretrain/hf_home:/hf_home "
                             f"{campaign.cluster.container.image} /host/adapt.sh bash ")
    inner = shlex.split(launch)[-1]
    assert inner.startswith(f"export HF_HOME=/hf_home; {CONTAINER_PYTHONPATH}; "
                            "python3 -m jobscripts.export_hf ")
    # 1: the recipe's HF model, resolved from HF_HOME by the job, never the tokenizer dir.
    args = shlex.split(inner.rsplit("; ", 1)[1])
    assert args[args.index("--hf-model") + 1] == "meta-llama/Meta-Llama-3.1-8B"
    # The tokenizer the segments loaded (data.tokenizer.path), beside the weights.
    assert args[args.index("--tokenizer") + 1] == campaign.data.tokenizer.path


def test_preflight_runs_in_the_training_image_without_a_gpu(jobs, campaign) -> None:
    script = _script("preflight", jobs["preflight"])
    d = _directives(script)
    assert "gpus-per-node" not in d and d["time"] == "00:30:00" and d["cpus-per-task"] == "8"
    assert f"{campaign.cluster.container.image} /host/adapt.sh bash " in script
    assert "export HF_HOME=/hf_home; " in script and "export HF_HOME" not in script.split(
        "\napptainer ", 1)[0]


@pytest.mark.parametrize("name", ["export", "evaluate"])
def test_container_jobs_put_the_shipped_code_before_the_images_pythonpath(jobs, name) -> None:
    """2: an image's own PYTHONPATH (the NeMo image sets one) wins over the host's inside
    apptainer, so the container command itself puts the shipped code first."""
    inner = shlex.split(_script(name, jobs[name]).splitlines()[-1])[-1]
    prefix = inner.split("; python3 -m ", 1)[0]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "/opt/megatron-lm",
           CODE_DIR_VAR: "/scratch/c/code/abc"}
    seen = subprocess.run(["bash", "-euo", "pipefail", "-c", f'{prefix}; echo "$PYTHONPATH"'],
                          env=env, capture_output=True, text=True, check=True).stdout
    assert seen == "/scratch/c/code/abc:/opt/megatron-lm\n"


def test_evaluate_runs_in_the_vllm_image_on_one_gpu(jobs) -> None:
    script = _script("evaluate", jobs["evaluate"])
    d = _directives(script)
    assert d["gpus-per-node"] == "1" and d["time"] == "01:00:00" and "exclusive" not in d
    assert "/scratch/pretrain/containers/vllm.sif /host/adapt.sh bash " in script
    assert "--backend vllm" in script


def test_a_bridge_campaign_must_name_its_evaluation_image() -> None:
    from operators.campaign.schema.load import CampaignConfigError as CampaignError

    with pytest.raises(CampaignError, match="stages.evaluate.image"):
        campaign_from_dict(edited(raw(LLAMA_8B), {"stages.evaluate": DELETE}))


# --- 3: site set-up and the entrypoint, quoted ---------------------------------------------
@pytest.mark.parametrize("name", [*DATA_STAGES, "preflight", "segment_1", "export",
                                  "evaluate"])
def test_site_setup_runs_before_every_command(jobs, name) -> None:
    lines = _script(name, jobs[name]).splitlines()
    at = lines.index("module load brics/nccl")
    assert lines[at - 1] == "set +u" and lines[at + 1] == "module load brics/apptainer-multi-node"
    assert lines[at + 2] == "set -u"
    launch = next(i for i, line in enumerate(lines) if line.startswith(
        ('"$PP_PYTHON"', "apptainer", "srun")))
    assert at < launch


@pytest.mark.parametrize(("field", "value"), [
    ("cluster.setup", ["module load x; rm -rf /"]),
    ("cluster.setup", ["module load $(id)"]),
    ("cluster.setup", ["source '/a b/env.sh'"]),
    ("cluster.setup", ["module load x\nrm -rf /"]),
    ("cluster.setup", [""]),
    ("cluster.container.entrypoint", "/host/adapt.sh | tee x"),
    ("cluster.container.entrypoint", "`id`"),
])
def test_setup_lines_and_entrypoints_are_plain_words(field, value) -> None:
    from operators.campaign.schema.load import CampaignConfigError as CampaignError

    with pytest.raises(CampaignError, match=re.escape(field)):
        campaign_from_dict(edited(raw(LLAMA_8B), {field: value}))


# --- the segment ----------------------------------------------------------------------------
def _srun(script: str) -> str:
    return next(line for line in script.splitlines() if line.startswith("srun "))


def test_segment_launch_line(jobs, campaign) -> None:
    script = _script("segment_1", jobs["segment_1"])
    srun = _srun(script)
    # 11: srun of Slurm 22.05-23.02 does not inherit the CPU count.
    assert srun.startswith('srun --mpi=pmi2 --ntasks-per-node=1 --kill-on-bad-exit=1 '
                           '--cpus-per-task="$SLURM_CPUS_PER_TASK" apptainer run --nv ')
    words = shlex.split(srun)
    image = words.index(campaign.cluster.container.image)
    assert words[image + 1:image + 3] == ["/host/adapt.sh", "bash"]  # 3: under the wrapper
    inner = words[-1]
    # 5: the container's environment inside, the host's outside.
    for export in ("HF_HOME=/hf_home", "HF_HUB_OFFLINE=1", "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert f"export {export};" in inner
        assert f"export {export}\n" not in script
    assert "export NCCL_DEBUG=WARN\n" in script
    # 9: retention after each save; 13: the job start the recorder measures from.
    assert inner.endswith("--keep-last 3 --keep-every 500")
    assert 'PP_JOB_START="$(date +%s)"' in script


def test_no_cpu_flag_without_a_cpu_count() -> None:
    c = campaign_from_dict(edited(raw(LLAMA_8B), {"cluster.cpus_per_task": DELETE}))
    inputs = RunInputs.of([PREFIX])
    assert "--cpus-per-task" not in bridge.bridge_job(c, inputs)[1]  # SLURM_CPUS_PER_TASK unset


def test_resumed_segment_uses_what_segment_1_measured(jobs) -> None:
    first = yaml.safe_load(jobs["segment_1"]["files"][bridge.CONFIG_FILE])
    second = yaml.safe_load(jobs["segment_2"]["files"][bridge.CONFIG_FILE])
    # 13: 240 - start-up estimate 3 - save estimate 2 - margin 5; then 240 - 2 - 1.5 - 5:
    # the start-up before Bridge's timer only, measured, not the estimate a second time.
    assert first["train"]["exit_duration_in_mins"] == 230
    assert second["train"]["exit_duration_in_mins"] == 231
    # 7: the trigger form's train_iters reaches the Bridge segment, schedule included.
    assert first["train"]["train_iters"] == 1000 and second["train"]["train_iters"] == 600
    assert second["scheduler"]["lr_decay_iters"] == 600
    # 9: Bridge keeps every save itself; retention is ours, after each save.
    assert first["checkpoint"]["most_recent_k"] == -1
    assert first["checkpoint"]["save_interval"] == 250


def test_blend_reaches_the_bridge_segment_as_weights_and_prefixes() -> None:
    # 6: the operator's own render path (it used to hand the weights to RunPaths as prefixes).
    c = campaign_from_dict(edited(raw(LLAMA_8B), {
        "data.source": DELETE,
        "data.blend": [{"weight": 0.7, "prefix": "/d/web"}, {"weight": 0.3, "prefix": "/d/code"}]}))
    op = TrainingSegmentOperator(campaign=c, segment=1, task_id="train.segment_1")
    layout = Layout.for_campaign(c)
    seg = op.render_segment(op._inputs(layout, None), [], 1000)
    tree = yaml.safe_load(seg.files[bridge.CONFIG_FILE])
    assert tree["dataset"]["data_path"] == ["0.7", "/d/web", "0.3", "/d/code"]


# --- the job side: progress, retention, start-up, the export's reference --------------------
def _saved(root: Path, iteration: int) -> None:
    """A save as Bridge leaves it: torch_dist's .metadata written last, then the tracker."""
    from jobscripts.checkpoints import checkpoint_dir, write_tracker

    checkpoint_dir(root, iteration).mkdir(parents=True)
    (checkpoint_dir(root, iteration) / ".metadata").write_bytes(b"x")
    write_tracker(root, iteration)


def _ctx(step: int):
    from types import SimpleNamespace

    return SimpleNamespace(state=SimpleNamespace(train_state=SimpleNamespace(
        step=step, consumed_train_samples=step * 128)), optimizer=None, loss_dict={},
        grad_norm=None)


def test_progress_is_the_last_save_not_the_last_step(tmp_path) -> None:
    # 12: trained to 120, saved at 100, then crashed: the campaign is at 100.
    from jobscripts.bridge_result import SegmentRecorder

    rec = SegmentRecorder(0.0)
    rec.configure(1000, 8192, str(tmp_path))
    rec.on_train_start(_ctx(0))
    for step in range(1, 121):
        rec.on_train_step_end(_ctx(step))
        if step == 100:
            _saved(tmp_path, 100)
            rec.on_checkpoint_save(_ctx(100))
    r = rec.finish(1, "RuntimeError: NCCL timeout")
    assert (r["end_iteration"], r["last_step"]) == (100, 120)


def test_retention_runs_after_each_save(tmp_path, monkeypatch) -> None:
    # 9: keep_last 2 and every 500th, on rank 0, through the callback Bridge calls.
    from types import SimpleNamespace

    from jobscripts.bridge_pretrain import parse_args, saved_callback
    from jobscripts.bridge_result import SegmentRecorder
    from jobscripts.checkpoints import list_checkpoints

    monkeypatch.setenv("RANK", "0")
    args, _ = parse_args(["--recipe", "llama31_8b", "--config-file", "b.yaml",
                          "--keep-last", "2", "--keep-every", "500"])
    rec = SegmentRecorder(0.0)
    rec.configure(1000, 8192, str(tmp_path))
    callback = saved_callback(rec, args)
    for iteration in (250, 500, 750, 1000):
        _saved(tmp_path, iteration)
        callback(_ctx(iteration))
    assert list_checkpoints(tmp_path) == [500, 750, 1000]
    monkeypatch.setenv("RANK", "1")  # other ranks never delete
    other = saved_callback(rec, SimpleNamespace(keep_last=1, keep_every=None))
    _saved(tmp_path, 1250)
    other(_ctx(1250))
    assert list_checkpoints(tmp_path) == [500, 750, 1000, 1250]


def test_startup_is_measured_from_the_job_start(monkeypatch) -> None:
    # 13: $PP_JOB_START (the batch script's date +%s) -> the call of pretrain().
    import time

    from jobscripts.bridge_result import SegmentRecorder

    rec = SegmentRecorder(time.monotonic())
    rec.timer_started(str(int(time.time()) - 100))
    assert 99 <= rec.result["startup_seconds"] <= 102
    rec.on_train_start(_ctx(0))  # later, after model build and checkpoint load: not counted
    assert rec.result["startup_seconds"] <= 102


def test_export_reference_resolves_from_hf_home(tmp_path, monkeypatch) -> None:
    # 1: the recipe's model id -> its snapshot in the HF cache; a tokenizer dir is refused.
    from huggingface_hub import constants

    from jobscripts.common import StepError
    from jobscripts.export_hf import resolve_hf_model

    model = tmp_path / "hub" / "models--meta-llama--Meta-Llama-3.1-8B"
    (model / "snapshots" / "c0ffee").mkdir(parents=True)
    (model / "snapshots" / "c0ffee" / "config.json").write_text("{}")
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text("c0ffee")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_hf_model("meta-llama/Meta-Llama-3.1-8B") == str(model / "snapshots" / "c0ffee")
    with pytest.raises(StepError, match="not in the Hugging Face cache"):
        resolve_hf_model("meta-llama/Llama-3.2-1B")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    with pytest.raises(StepError, match="no config.json"):
        resolve_hf_model(str(tokenizer))

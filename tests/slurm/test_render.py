"""Rendering: golden files for whole scripts, and every field's rejection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from operators.slurm.render import render_script
from operators.slurm.spec import ContainerSpec, JobSpec, JobSpecError

GOLDEN = Path(__file__).parent / "golden"

SPECS = {
    "minimal": JobSpec(name="pp-hello-0123456789abcdef", command="echo hello",
                       output="/scratch/run/slurm-%j.out"),
    "full": JobSpec(
        name="pp-train-segment_2-0123456789abcdef", comment="pp-train-segment_2-0123456789abcdef",
        command="python -m jobscripts.reference_trainer --config run.json",
        output="/scratch/run/slurm-%j.out", error="/scratch/run/slurm-%j.err",
        workdir="/scratch/run", partition="gpu", account="brics.a5k", qos="normal",
        nodes=2, ntasks_per_node=1, cpus_per_task=72, gpus_per_node="4", mem="0",
        time="02:00:00", exclusive=True, signal="B:TERM@300", dependency="afterok:41:42",
        exclude="nid[001-002]", requeue=True,
        environment={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "HF_HUB_OFFLINE": "1",
                     "NOTE": "it's $HOME; `rm -rf /`"},
    ),
    "container": JobSpec(
        name="pp-export-0123456789abcdef", command="python export.py --iteration 50",
        output="/scratch/run/slurm-%j.out", array="0-9%2", nodes=1, gpus_per_node="h100:1",
        container=ContainerSpec(image="/images/nemo_26.04.sif",
                                binds=("/scratch:/scratch", "/home/u/.cache:/root/.cache:ro")),
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden(name: str) -> None:
    text = render_script(SPECS[name])
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_rendering_is_stable() -> None:
    assert render_script(SPECS["full"]) == render_script(SPECS["full"])


def test_environment_values_are_quoted_not_executed(tmp_path: Path) -> None:
    import subprocess

    marker = tmp_path / "pwned"
    spec = JobSpec(name="x", output="/tmp/o", command='printf "%s" "$EVIL"',
                   environment={"EVIL": f"$(touch {marker}); `touch {marker}`\nnext"})
    script = tmp_path / "job.sh"
    script.write_text(render_script(spec))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True)
    assert not marker.exists()
    assert out.stdout.endswith(f"$(touch {marker}); `touch {marker}`\nnext")


BAD = [
    ("name", "a\nb"), ("name", "a b"), ("name", "$(id)"), ("name", ""), ("name", "-x"),
    ("comment", "x;y"), ("output", "/tmp/a b"), ("output", "/tmp/$(id)"),
    ("output", "/tmp/x\n#SBATCH --uid=0"), ("error", "`id`"), ("workdir", "/tmp/'x'"),
    ("partition", "gpu;id"), ("account", "a\nb"), ("qos", "q q"),
    ("nodes", 0), ("nodes", -1), ("nodes", "2"), ("nodes", True), ("cpus_per_task", 0),
    ("gpus_per_node", "4;id"), ("mem", "16GB"), ("mem", "-1"), ("time", "2h"),
    ("time", "1:00\n"), ("signal", "TERM@1;id"), ("dependency", "afterok:1 2"),
    ("array", "0-3;id"), ("exclude", "n1 n2"), ("command", ""), ("command", "a\x00b"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_values_are_rejected_naming_the_field(field: str, value: object) -> None:
    base = {"name": "ok", "command": "true", "output": "/tmp/o"}
    with pytest.raises(JobSpecError) as err:
        render_script(JobSpec(**{**base, field: value}))
    assert err.value.field_name == field
    assert repr(field) in str(err.value)


@pytest.mark.parametrize("env", [{"A B": "x"}, {"1X": "y"}, {"X;Y": "z"}])
def test_bad_environment_names(env: dict[str, str]) -> None:
    with pytest.raises(JobSpecError, match="environment"):
        JobSpec(name="ok", command="true", output="/tmp/o", environment=env).validate()


def test_bad_container_bind() -> None:
    spec = JobSpec(name="ok", command="true", output="/tmp/o",
                   container=ContainerSpec(image="/i.sif", binds=("/a:/b;id",)))
    with pytest.raises(JobSpecError, match=r"container\.binds\[0\]"):
        spec.validate()


def test_het_job_components_follow_hetjob_separators() -> None:
    # Slurm 22.05 batch syntax (doc/html/heterogeneous_jobs.shtml, SchedMD/slurm): each further
    # component's options after a line "#SBATCH hetjob"; job-wide options in the first.
    spec = JobSpec(name="pp-launch-0123456789abcdef", command="srun --het-group=0,1 hostname",
                   output="/r/slurm-%j.out", time="10", cpus_per_task=1, mem="100M",
                   het_components=[{"cpus_per_task": 2, "mem": "100M", "nodes": 2},
                                   {"partition": "gpu", "gpus_per_node": "4"}])
    directives = [line for line in render_script(spec).splitlines() if line.startswith("#SBATCH")]
    first = directives.index("#SBATCH hetjob")
    assert "#SBATCH --time=10" in directives[:first]
    assert directives[first:] == [
        "#SBATCH hetjob", "#SBATCH --nodes=2", "#SBATCH --cpus-per-task=2", "#SBATCH --mem=100M",
        "#SBATCH hetjob", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=4"]


@pytest.mark.parametrize(("components", "extra", "field"), [
    ([{"mem": "16GB"}], {}, "het_components[0].mem"),
    ([{}, {"partition": "gpu;id"}], {}, "het_components[1].partition"),
    ([{"time": "10"}], {}, "het_components[0]"),  # job-wide: only in the first component
    (["cpus=2"], {}, "het_components[0]"),
    ([{}], {"array": "0-3"}, "het_components"),  # sbatch(1): no arrays of het jobs
])
def test_bad_het_components_are_rejected_naming_the_field(components, extra, field) -> None:
    with pytest.raises(JobSpecError) as err:
        JobSpec(name="ok", command="true", output="/tmp/o", het_components=components,
                **extra).validate()
    assert err.value.field_name == field

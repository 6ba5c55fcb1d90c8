"""The reference trainer's segment job on several nodes: the production launch shape (one
``srun`` task per node starting ``torchrun``) minus the container and the GPUs.

The rendered script is run by bash with stand-ins for ``scontrol``, ``srun`` and the Python,
to see what each node's torchrun really gets once the shell has expanded it. ``scontrol``
replays the local cluster's real output (Slurm 22.05.8: ``scontrol show hostnames node[1-2]``
and ``scontrol show node node1``, recorded 2026-12-01)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from operators.campaign.render.layout import Layout
from operators.campaign.render.paths import RunInputs
from operators.campaign.render.reference import reference_segment
from operators.campaign.schema.load import CampaignConfigError, campaign_from_dict
from operators.slurm.operator import PYTHON_ENV, build_spec
from operators.slurm.render import render_script
from tests.campaign.util import edited, raw

pytestmark = pytest.mark.pure

CI_CAMPAIGN = Path(__file__).resolve().parents[1] / "campaigns" / "ci_campaign.yaml"

SCONTROL_SHOW_NODE1 = (  # trailing blanks are Slurm's
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1 \n"
    "   CPUAlloc=0 CPUEfctv=32 CPUTot=32 CPULoad=10.58\n"
    "   AvailableFeatures=(null)\n"
    "   ActiveFeatures=(null)\n"
    "   Gres=gpu:4\n"
    "   NodeAddr=10.77.0.11 NodeHostName=node1 Version=22.05.8\n"
    "   OS=Linux 6.18.44-fc-v1045 #1 SMP PREEMPT_DYNAMIC @0 \n"
    "   RealMemory=24105 AllocMem=0 FreeMem=14930 Sockets=32 Boards=1\n"
    "   State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n"
    "   Partitions=debug,gpu \n"
)


def campaign(nodes: int, **changes):
    return campaign_from_dict(edited(raw(CI_CAMPAIGN), {"cluster.nodes": nodes, **changes}))


def segment(nodes: int):
    c = campaign(nodes)
    return reference_segment(c, Layout.for_campaign(c), RunInputs.of(["/data/x_text_document"]))


def run_script(tmp_path: Path, request) -> list[list[str]]:
    """Run the batch script; each line of the result: one torchrun's argv, per node."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (tmp_path / "node1.txt").write_text(SCONTROL_SHOW_NODE1)
    scripts = {
        "scontrol": f"""case "$1 $2" in
  "show hostnames") [ "$3" = "node[1-2]" ] && printf 'node1\\nnode2\\n' ;;
  "show node") [ "$3" = node1 ] && cat {tmp_path}/node1.txt ;;
  *) exit 9 ;;
esac""",
        # Slurm starts the task once per node with that node's SLURM_NODEID.
        "srun": 'while [ "${1#--}" != "$1" ]; do echo "$1" >> "$PP_OUT/srun.flags"; shift; done\n'
                'for n in 0 1; do SLURM_NODEID=$n "$@" || exit $?; done',
        "python": 'printf "%s\\n" "$*" >> "$PP_OUT/torchrun.txt"',
    }
    for name, body in scripts.items():
        (stubs / name).write_text("#!/bin/bash\n" + body + "\n")
        (stubs / name).chmod(0o755)
    env = {PYTHON_ENV: str(stubs / "python"), **request.environment}
    spec = build_spec("pp-test", str(tmp_path), request.command, request.job, env)
    (tmp_path / "job.sbatch").write_text(render_script(spec))
    subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, check=True,
                   env={"PATH": f"{stubs}:/usr/bin:/bin", "PP_OUT": str(tmp_path),
                        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2",
                        "SLURM_CPUS_PER_TASK": "1"})
    flags = (tmp_path / "srun.flags").read_text().split()
    return flags, [line.split() for line in (tmp_path / "torchrun.txt").read_text().splitlines()]


def test_two_nodes_start_one_torchrun_per_node_with_its_rank_and_the_first_nodes_address(
        tmp_path):
    request = segment(2)
    assert (request.job["nodes"], request.job["ntasks_per_node"]) == (2, 1)
    # Not B:: the batch shell is not the trainer; srun hands the signal to the tasks.
    assert request.job["signal"].startswith("TERM@") and request.job["requeue"] is True
    flags, per_node = run_script(tmp_path, request)
    assert "--kill-on-bad-exit=1" in flags and "--ntasks-per-node=1" in flags
    assert "--cpus-per-task=1" in flags  # Slurm 22.05 srun ignores SLURM_CPUS_PER_TASK
    assert len(per_node) == 2
    for rank, argv in enumerate(per_node):
        assert argv[:2] == ["-m", "torch.distributed.run"]
        options = dict(zip(argv[2:12:2], argv[3:12:2], strict=True))
        assert options == {"--nnodes": "2", "--nproc-per-node": "1", "--node-rank": str(rank),
                           "--master-addr": "10.77.0.11", "--master-port": "29500"}
        assert argv[12:] == ["-m", "jobscripts.reference_trainer", "--config", "run.json"]


def test_one_node_keeps_the_trainer_as_the_batch_shell():
    request = segment(1)
    assert "nodes" not in request.job and request.job["signal"].startswith("B:TERM@")
    assert "srun" not in request.command and "torch.distributed.run" not in request.command
    assert request.command.splitlines()[-1].startswith('exec "$PP_PYTHON" -m ')


def test_global_batch_must_split_over_the_nodes():
    assert campaign(2).world_size == 2
    with pytest.raises(CampaignConfigError, match="training.global_batch_size"):
        campaign(3)  # 8 samples, micro-batch 4: not a multiple of 4 x 3

"""``pretrain-pipeline check FILE...``: the DAG file's own validation, for people and CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from operators.cli import main
from tests.campaign.util import DEMO, LLAMA_8B, dump, edited, raw

SCRIPT = Path(sys.executable).parent / "pretrain-pipeline"


def test_valid_campaigns_print_their_plan(capsys) -> None:
    assert main(["check", str(DEMO), str(LLAMA_8B)]) == 0
    out = capsys.readouterr().out
    assert f"{DEMO}: ok" in out and f"{LLAMA_8B}: ok" in out
    for fragment in ("Segment plan: a first DAG run submits", "min of training",
                     "Tokens planned:", "Epochs:", "Tokens per parameter:", "Slurm requests:",
                     # the 8B segment: 2 nodes x 4 GPUs, from the Bridge job's own options
                     "train.segment_1: partition=workq nodes=2 ntasks_per_node=1 "
                     "gpus_per_node=4",
                     "data.tokenize: partition=workq cpus_per_task=32",
                     "train.preflight: partition=workq"):
        assert fragment in out, fragment


def test_each_problem_is_file_line_field_message(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(dump(edited(raw(DEMO), {"training.lr": -1, "cluster.nodes": 0})))
    line = {k: i for i, s in enumerate(bad.read_text().splitlines(), 1)
            for k in ("lr:", "nodes:") if s.strip().startswith(k)}
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"# caf\xe9\n" + DEMO.read_bytes())
    assert main(["check", str(DEMO), str(bad), str(latin), str(tmp_path / "absent.yaml")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{bad}:{line['lr:']}: training.lr: Input should be greater than 0" in out
    assert any(s.startswith(f"{bad}:{line['nodes:']}: cluster.nodes: ") for s in out)
    assert any(s.startswith(f"{latin}:1: not UTF-8") for s in out)
    assert any(s.startswith(f"{tmp_path / 'absent.yaml'}: not a campaign file") for s in out)
    assert f"{DEMO}: ok" in out  # the valid one is still checked and planned


def test_the_console_script_exits_non_zero_on_any_error(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEMO.read_text().replace("name: demo", "name: '../x'"))
    good = subprocess.run([str(SCRIPT), "check", str(DEMO)], capture_output=True, text=True)
    assert good.returncode == 0, good.stdout + good.stderr
    failed = subprocess.run([str(SCRIPT), "check", str(DEMO), str(bad)], capture_output=True,
                            text=True)
    assert failed.returncode == 1 and f"{bad}:" in failed.stdout and "name:" in failed.stdout
    assert "Traceback" not in failed.stdout + failed.stderr

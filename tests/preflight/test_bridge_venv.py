"""The local Bridge venv (docker/bridge_venv.sh), as `make cluster-up` leaves it: a second run
changes nothing, the cluster user runs it, Bridge and Core are the pinned versions, the
Transformer Engine in it is the documented stand-in, and no copy of this project is in it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
VENV = Path("/opt/pretrain-pipeline/bridge-venv")
PROBE = """
import importlib.metadata as md, importlib.util as iu
import transformer_engine
print(md.version("megatron-bridge"), md.version("megatron-core"), md.version("transformers"))
print(transformer_engine.STAND_IN, iu.find_spec("operators"), iu.find_spec("jobscripts"))
"""


def test_second_run_changes_nothing(local_cluster) -> None:
    stamp = (VENV / ".stamp.sha256").read_text()
    proc = subprocess.run(["bash", str(REPO / "docker" / "bridge_venv.sh")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "up to date" in proc.stderr, proc.stderr
    assert (VENV / ".stamp.sha256").read_text() == stamp


def test_the_cluster_user_runs_pinned_bridge_without_the_project(local_cluster) -> None:
    proc = subprocess.run(["su", "-s", "/bin/sh", "pretrain", "-c",
                           f"cd / && {VENV}/bin/python -c '{PROBE}'"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    versions, standin = proc.stdout.splitlines()[-2:]
    assert versions == "0.6.2 0.19.2 5.12.1"
    assert standin == "True None None"  # the stand-in; neither operators nor jobscripts

"""The command lines sent to the login node (operators/slurm/commands.py), run by a real bash."""

from __future__ import annotations

import os
import subprocess

import pytest

from operators.slurm import commands


@pytest.fixture
def fake_slurm(tmp_path):
    """``scancel`` that records its arguments, first on PATH."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\n')
    (bin_dir / "scancel").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return env, calls


def test_scancel_of_a_killed_task_notes_the_job_in_its_run_dir(tmp_path, fake_slurm) -> None:
    env, calls = fake_slurm
    run_dir = tmp_path / "run dir;$(touch pwned)`touch pwned2`"
    run_dir.mkdir()
    subprocess.run(["bash", "-c", commands.scancel("4242", str(run_dir))], env=env,
                   cwd=tmp_path, check=True)
    subprocess.run(["bash", "-c", commands.scancel("4343", str(run_dir))], env=env,
                   cwd=tmp_path, check=True)
    assert (run_dir / commands.KILLED_JOBS).read_text() == "4242\n4343\n"
    assert calls.read_text() == "4242\n4343\n"
    assert not list(tmp_path.glob("pwned*"))


def test_plain_scancel_notes_nothing(tmp_path, fake_slurm) -> None:
    env, calls = fake_slurm
    subprocess.run(["bash", "-c", commands.scancel("7")], env=env, cwd=tmp_path, check=True)
    assert calls.read_text() == "7\n"
    assert not list(tmp_path.rglob(commands.KILLED_JOBS))


@pytest.mark.parametrize("build", [
    lambda: commands.sacct_jobs(["1", "2;reboot"]),
    lambda: commands.squeue_jobs(["1", "$(reboot)"]),
    lambda: commands.sacct_name("pp-x`reboot`"),
])
def test_every_argument_is_one_shell_word(build) -> None:
    line = build()
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {line.split(' ', 1)[1]}"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert not any(w in ("reboot", ";reboot") for w in words)
    assert any(("reboot" in w) for w in words)  # kept as data inside one argument

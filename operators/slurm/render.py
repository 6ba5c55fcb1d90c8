"""Job spec -> sbatch script text. Pure: same spec, same bytes.

Directives go in a fixed order so that a rendered script diffs cleanly against
its golden file. Values were validated by :mod:`operators.slurm.spec`; the
environment and the container command are shell-quoted here as well, because
validation allows any character in an environment value.
"""

from __future__ import annotations

import shlex

from operators.slurm.spec import HET_FIELDS, HetComponent, JobSpec

# (directive, JobSpec attribute) in output order; None values are left out.
_VALUED = (
    ("job-name", "name"),
    ("comment", "comment"),
    ("output", "output"),
    ("error", "error"),
    ("chdir", "workdir"),
    ("partition", "partition"),
    ("account", "account"),
    ("qos", "qos"),
    ("nodes", "nodes"),
    ("ntasks", "ntasks"),
    ("ntasks-per-node", "ntasks_per_node"),
    ("cpus-per-task", "cpus_per_task"),
    ("gpus-per-node", "gpus_per_node"),
    ("mem", "mem"),
    ("time", "time"),
    ("signal", "signal"),
    ("dependency", "dependency"),
    ("array", "array"),
    ("exclude", "exclude"),
)


def _valued(spec: JobSpec | HetComponent, names: tuple[str, ...] | None = None) -> list[str]:
    return [f"#SBATCH --{flag}={getattr(spec, attr)}" for flag, attr in _VALUED
            if (names is None or attr in names) and getattr(spec, attr) is not None]


def render_directives(spec: JobSpec) -> list[str]:
    lines = _valued(spec)
    if spec.exclusive:
        lines.append("#SBATCH --exclusive")
    lines.append("#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue")
    # Append, never truncate: a requeued job restarts the script and must not
    # erase the log of its first run.
    lines.append("#SBATCH --open-mode=append")
    # A dependency that can never be met must fail, not pend forever.
    if spec.dependency is not None:
        lines.append("#SBATCH --kill-on-invalid-dep=yes")
    # A heterogeneous job: each further component's own resources after a separator line.
    for component in spec.het_components:
        lines += ["#SBATCH hetjob", *_valued(component, HET_FIELDS)]
    return lines


def render_container_prefix(spec: JobSpec) -> str:
    """The command prefix that runs the job's command inside its container."""
    if spec.container is None:
        return ""
    c = spec.container
    parts = [c.runtime, "exec"]
    if c.nv:
        parts.append("--nv")
    for bind in c.binds:
        parts += ["--bind", bind]
    parts.append(c.image)
    return " ".join(shlex.quote(p) for p in parts) + " "


def render_script(spec: JobSpec) -> str:
    """Render the whole sbatch script for ``spec`` (validated first)."""
    spec.validate()
    body = ["#!/bin/bash", *render_directives(spec), "", "set -euo pipefail"]
    # Printed first so that a requeued job's appended log shows where each run starts.
    body.append('echo "[pretrain-pipeline] job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}'
                ' on $(hostname) at $(date -u +%FT%TZ)"')
    for key in sorted(spec.environment):
        body.append(f"export {key}={shlex.quote(spec.environment[key])}")
    if spec.container is None:
        body.append(spec.command.rstrip("\n"))
    else:
        body.append(render_container_prefix(spec) + "bash -euo pipefail -c "
                    + shlex.quote(spec.command.rstrip("\n")))
    return "\n".join(body) + "\n"

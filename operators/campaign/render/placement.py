"""Where each job of a campaign runs, and how its command is launched there. Pure.

A training segment takes the whole ``cluster`` section (its nodes, GPUs, CPUs, time limit,
the training image). Every other stage has its own placement (``stages.<name>`` in the
campaign), each unset field defaulting per stage, so a tokenizer run is not billed as a
GPU node for four hours:

    data       the host's Python (no image), no GPU, 4 CPUs (tokenize: its workers), the
               cluster's time limit
    preflight  the training image, no GPU, 8 CPUs, 30 min
    export     the training image, no GPU (Bridge exports on CPU), 16 CPUs, 2 h
    evaluate   a vLLM image (required for a Bridge campaign), 1 GPU, 8 CPUs, 1 h;
               the reference campaign evaluates on the host's CPUs

The partition, account and QoS default to the cluster's. A stage in an image gets the
container's binds, entrypoint and environment; ``cluster.setup`` runs before every job.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from operators.campaign.schema.fields import render_words

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

HOST = "host"  # stages.<name>.image: run on the host, not in a container
TRAINING = "training"  # a default: the training container's image
CONTAINER_PYTHON = "python3"  # the image's own interpreter ($PP_PYTHON is the host's)

# Names the shipped code's directory in every job's host environment. Apptainer hands the host's
# environment to the container, but an image's own PYTHONPATH (the NeMo image sets one) wins over
# the host's, so a container command prepends this to the image's PYTHONPATH itself.
CODE_DIR_VAR = "PP_CODE_DIR"
CONTAINER_PYTHONPATH = (f'[ -z "${{{CODE_DIR_VAR}:-}}" ] || '
                        f'export PYTHONPATH="${CODE_DIR_VAR}${{PYTHONPATH:+:$PYTHONPATH}}"')


@dataclass(frozen=True)
class StageDefault:
    image: str  # HOST or TRAINING; evaluate's image has no default
    gpus_per_node: int
    cpus_per_task: int
    time_limit: str | None  # None: the cluster's


DEFAULTS = {
    "data": StageDefault(HOST, 0, 4, None),
    "preflight": StageDefault(TRAINING, 0, 8, "00:30:00"),
    "export": StageDefault(TRAINING, 0, 16, "02:00:00"),
    "evaluate": StageDefault(HOST, 1, 8, "01:00:00"),
}


@dataclass(frozen=True)
class Launch:
    """The resolved placement of one stage's job."""

    job: dict  # sbatch options for build_spec
    image: str | None  # None: the host
    binds: tuple[str, ...] = ()
    entrypoint: str | None = None
    environment: Mapping[str, str] | None = None  # exported inside the container only

    @property
    def python(self) -> str:
        return CONTAINER_PYTHON if self.image else '"$PP_PYTHON"'


def _image(campaign: Campaign, stage: str, default: StageDefault) -> str | None:
    given = getattr(campaign.stages, stage).image
    container = campaign.cluster.container
    if given == HOST:
        return None
    if given is not None:
        return given
    if default.image == TRAINING and container is not None:
        return container.image
    return None


def stage_launch(campaign: Campaign, stage: str, cpus: int | None = None) -> Launch:
    """``stage`` is ``data``, ``preflight``, ``export`` or ``evaluate``; ``cpus``, when
    given, wins (tokenize runs ``data.tokenize_workers`` workers, one per CPU)."""
    default, given, c = DEFAULTS[stage], getattr(campaign.stages, stage), campaign.cluster
    gpus = given.gpus_per_node
    if gpus is None:
        # The reference campaign's evaluation runs on CPU: there are no GPUs to ask for.
        gpus = default.gpus_per_node if c.gpus_per_node else 0
    job = {name: value for name, value in (("partition", given.partition or c.partition),
                                           ("account", c.account), ("qos", c.qos))
           if value is not None}
    job["time"] = given.time_limit or default.time_limit or c.time_limit
    small = default.cpus_per_task
    if stage == "data" and c.cpus_per_task:
        small = min(small, c.cpus_per_task)  # never more than a training task has
    job["cpus_per_task"] = cpus or given.cpus_per_task or small
    if gpus:
        job["gpus_per_node"] = str(gpus)
    if given.mem or (stage == "data" and c.mem):
        job["mem"] = given.mem or c.mem
    image = _image(campaign, stage, default)
    if image is None:
        return Launch(job=job, image=None)
    container = c.container  # an image without a training container: no binds to share
    return Launch(job=job, image=image, binds=tuple(container.binds) if container else (),
                  entrypoint=container.entrypoint if container else None,
                  environment=dict(container.environment) if container else {})


def setup_lines(campaign: Campaign) -> list[str]:
    """``cluster.setup`` as script lines, every word quoted. ``set +u`` around them:
    environment-module scripts read unset variables, which ``set -u`` would make fatal."""
    if not campaign.cluster.setup:
        return []
    return ["set +u", *(render_words(line) for line in campaign.cluster.setup), "set -u"]


def export_lines(environment: Mapping[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in sorted(environment.items())]


def container_argv(image: str, binds: tuple[str, ...] | list[str], entrypoint: str | None,
                   *, verb: str = "exec") -> str:
    """``apptainer <verb> --nv --bind ... IMAGE [ENTRYPOINT ...]``, quoted word by word."""
    words = ["apptainer", verb, "--nv"]
    for bind in binds:
        words += ["--bind", bind]
    words.append(image)
    prefix = " ".join(shlex.quote(w) for w in words)
    return prefix + (" " + render_words(entrypoint) if entrypoint else "")


def in_container(launch: Launch, inner: str) -> str:
    """``inner`` (a shell command) run in the launch's image: the container's environment is
    exported by the inner shell, after any entrypoint, so nothing the host sets can hide it
    and no host job ever gets it."""
    body = "; ".join([*export_lines(launch.environment or {}), inner])
    return (container_argv(launch.image, launch.binds, launch.entrypoint)
            + " bash -euo pipefail -c " + shlex.quote(body))


def stage_command(campaign: Campaign, launch: Launch, module: str, *args: object) -> str:
    """The job's whole command: set-up lines, then ``python -m module args`` (each argument
    quoted) with the host's or the image's Python, in its image when it has one."""
    command = " ".join([launch.python, "-m", shlex.quote(module),
                        *(shlex.quote(str(a)) for a in args)])
    if launch.image:
        command = in_container(launch, f"{CONTAINER_PYTHONPATH}; {command}")
    return "\n".join([*setup_lines(campaign), command])

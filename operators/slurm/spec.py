"""The Slurm job spec and the validation of everything that reaches a script.

Every value here ends up either on an ``#SBATCH`` line, which Slurm parses
without a shell but splits on whitespace, or in the script body, which bash
runs. So each field is checked against the narrowest alphabet that serves it,
and a rejection names the field: a bad spec must fail in Airflow, before any
SSH, never on a compute node an hour later.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass

# Alphabets. Slurm's own filename patterns (%j, %x, %A, %a) need '%'.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_PATH = re.compile(r"^[A-Za-z0-9_./%@+=:,-]{1,1024}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MEMORY = re.compile(r"^[0-9]+[KMGT]?$")
_TIME = re.compile(r"^(?:[0-9]+-)?[0-9]{1,4}(?::[0-9]{1,2}){0,2}$")
_SIGNAL = re.compile(r"^(?:[BR]:)?(?:SIG)?[A-Z0-9]{1,8}(?:@[0-9]{1,6})?$")
_DEPENDENCY = re.compile(r"^[a-z]+(?::[0-9_]+(?:\+[0-9]+)?)+(?:[,?][a-z]+(?::[0-9_]+)+)*$")
_ARRAY = re.compile(r"^[0-9]+(?:-[0-9]+)?(?::[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*(?:%[0-9]+)?$")
_NODELIST = re.compile(r"^[A-Za-z0-9_.\[\],-]{1,1024}$")
_GPUS = re.compile(r"^(?:[A-Za-z0-9_-]{1,32}:)?[0-9]{1,3}$")


class JobSpecError(ValueError):
    """A job spec field holds a value that must not reach a script."""

    def __init__(self, field_name: str, value: object, why: str) -> None:
        self.field_name = field_name
        super().__init__(f"job spec field {field_name!r}: {why} (got {value!r})")


def _check(field_name: str, value: str | None, pattern: re.Pattern[str], what: str) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise JobSpecError(field_name, value, f"must be a string ({what})")
    if "\n" in value or "\r" in value or "\x00" in value:
        raise JobSpecError(field_name, value, "newlines and NUL are not allowed")
    if not pattern.match(value):
        raise JobSpecError(field_name, value, f"must be {what}")


def _check_positive(field_name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JobSpecError(field_name, value, "must be a positive integer")


@dataclass(frozen=True)
class ContainerSpec:
    """An Apptainer container the command runs in (``apptainer exec``)."""

    image: str
    binds: tuple[str, ...] = ()
    nv: bool = True  # expose the node's NVIDIA driver and GPUs to the container
    runtime: str = "apptainer"

    def validate(self) -> None:
        _check("container.image", self.image, _PATH, "an image path or URI without spaces")
        _check("container.runtime", self.runtime, _NAME, "a command name")
        for i, bind in enumerate(self.binds):
            _check(f"container.binds[{i}]", bind, _PATH, "src[:dst[:opts]] without spaces")


# The options a further component of a heterogeneous job sets for itself; job-wide ones
# (name, output, time, signal, dependency, requeue) come from the first component.
HET_FIELDS = ("partition", "account", "qos", "nodes", "ntasks", "ntasks_per_node",
              "cpus_per_task", "gpus_per_node", "mem", "exclude")


def _check_resources(spec: JobSpec | HetComponent, prefix: str = "") -> None:
    for name in ("partition", "account", "qos"):
        _check(prefix + name, getattr(spec, name), _NAME, "letters, digits, '.', '_', '-'")
    for name in ("nodes", "ntasks", "ntasks_per_node", "cpus_per_task"):
        _check_positive(prefix + name, getattr(spec, name))
    _check(prefix + "gpus_per_node", spec.gpus_per_node, _GPUS,
           "a count, optionally 'type:count'")
    _check(prefix + "mem", spec.mem, _MEMORY, "a size such as 16G")
    _check(prefix + "exclude", spec.exclude, _NODELIST, "a node list such as node[01-03]")


def _het_components(value: object) -> tuple[HetComponent, ...]:
    """``het_components`` as given (mappings from a DAG or YAML, or components) -> typed."""
    if not isinstance(value, list | tuple):
        raise JobSpecError("het_components", value, "must be a list of components")
    found = []
    for i, item in enumerate(value):
        if isinstance(item, HetComponent):
            found.append(item)
            continue
        if not isinstance(item, Mapping):
            raise JobSpecError(f"het_components[{i}]", item, "must be a mapping")
        unknown = sorted(set(item) - set(HET_FIELDS))
        if unknown:
            raise JobSpecError(f"het_components[{i}]", item,
                               f"unknown option(s) {unknown}; allowed: {list(HET_FIELDS)}")
        found.append(HetComponent(**item))
    return tuple(found)


@dataclass(frozen=True)
class JobSpec:
    """Everything ``sbatch`` needs for one job. Frozen: a spec is a value."""

    name: str
    command: str
    output: str  # log path; stdout and stderr both go there unless ``error`` is set
    comment: str | None = None  # carries the job key
    error: str | None = None
    workdir: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes: int | None = None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    gpus_per_node: str | None = None  # "4" or "h100:4"
    mem: str | None = None  # "16G"; "0" means all of the node's memory
    time: str | None = None  # Slurm time: "MM", "HH:MM:SS", "D-HH:MM:SS"
    exclusive: bool = False
    signal: str | None = None  # "TERM@120", "B:USR1@300"
    dependency: str | None = None  # "afterok:123:124"
    array: str | None = None  # "0-9%2"
    exclude: str | None = None  # nodes a retry must avoid
    requeue: bool = False
    environment: Mapping[str, str] = field(default_factory=dict)
    container: ContainerSpec | None = None
    # Further components of a heterogeneous job; this spec's own resources are component 0.
    het_components: tuple[HetComponent, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "het_components", _het_components(self.het_components))

    def validate(self) -> JobSpec:
        """Raise :class:`JobSpecError` naming the first bad field; return self."""
        _check("name", self.name, _NAME, "letters, digits, '.', '_', '-' (max 200)")
        _check("comment", self.comment, _NAME, "letters, digits, '.', '_', '-'")
        for name in ("output", "error", "workdir"):
            _check(name, getattr(self, name), _PATH, "a path of [A-Za-z0-9_./%@+=:,-]")
        _check_resources(self)
        _check("time", self.time, _TIME, "a Slurm time such as 30, 02:00:00 or 1-00:00:00")
        _check("signal", self.signal, _SIGNAL, "a signal spec such as TERM@120 or B:USR1@300")
        _check("dependency", self.dependency, _DEPENDENCY, "a dependency such as afterok:123")
        _check("array", self.array, _ARRAY, "an array range such as 0-9%2")
        for i, component in enumerate(self.het_components):
            component.validate(f"het_components[{i}].")
        if self.het_components and self.array is not None:
            raise JobSpecError("het_components", self.het_components,
                               "a heterogeneous job cannot be an array (sbatch(1))")
        if not isinstance(self.command, str) or not self.command.strip():
            raise JobSpecError("command", self.command, "must be a non-empty string")
        if "\x00" in self.command:
            raise JobSpecError("command", self.command, "NUL is not allowed")
        for key, value in self.environment.items():
            _check("environment", key, _ENV_NAME, "a shell variable name")
            if not isinstance(value, str) or "\x00" in value:
                raise JobSpecError(f"environment.{key}", value, "must be a string without NUL")
        if self.container is not None:
            self.container.validate()
        return self


def _validate_component(self: HetComponent, prefix: str) -> None:
    _check_resources(self, prefix)


# A further component of a heterogeneous job, after an ``#SBATCH hetjob`` line (Slurm 22.05's
# separator): e.g. workers beside a launcher. Its fields are JobSpec's of the same names.
HetComponent = make_dataclass(
    "HetComponent",
    [(name, JobSpec.__dataclass_fields__[name].type, field(default=None)) for name in HET_FIELDS],
    frozen=True, namespace={"validate": _validate_component, "__module__": __name__})

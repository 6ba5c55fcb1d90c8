"""Checked scalar types of the campaign schema: every string that can reach a script.

A campaign value travels into ``#SBATCH`` lines, shell commands and YAML read on the
cluster; a newline there starts a new directive and a ``;`` a new command. So each type
admits the narrowest alphabet that serves it, and pydantic reports a rejection at the
field's path (``cluster.container.binds.1``) before anything is rendered. The alphabets
mirror ``operators.slurm.spec`` so a campaign that validates here also passes ``JobSpec``.
"""

from __future__ import annotations

import math
import re
import shlex
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, Strict

from jobscripts.hf_fetch import parse_hf_uri
from jobscripts.s3_fetch import parse_s3_uri

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CONN_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}$")
_PATH = re.compile(r"^[A-Za-z0-9_./@+=:,-]{1,1024}$")  # spec._PATH without Slurm's '%'
_GLOB = re.compile(r"^[A-Za-z0-9_./@+=:,*?\[\]-]{1,1024}$")
_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Exported values are shell-quoted, so these would arrive literally, never expanded: a value
# holding them is almost surely a mistake (or an injection attempt), so it is refused.
_ENV_VALUE_BAD = re.compile(r"[$`;|&<>\\]")
# Judged per '_'-separated word, so TOKENIZERS_PARALLELISM passes and HF_TOKEN does not.
_SECRET_WORD = re.compile(r"^(?:\w*(?:TOKEN|SECRET|PASSWORD|PASSWD)S?|KEYS?|\w*APIKEY|PAT|"
                          r"CREDENTIALS?|PRIVATE)$")
_MEMORY = re.compile(r"^[0-9]+[KMGT]?$")
_SLURM_TIME = re.compile(
    r"^(?:(?P<d>[0-9]+)-(?P<dh>[0-9]{1,2})(?::(?P<dm>[0-9]{1,2})(?::(?P<ds>[0-9]{1,2}))?)?"
    r"|(?P<a>[0-9]+)(?::(?P<b>[0-9]{1,2})(?::(?P<c>[0-9]{1,2}))?)?)$")


def _clean(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("newlines, tabs, NUL and other control characters are not allowed")
    return value


def _matching(pattern: re.Pattern[str], what: str):
    def check(value: str) -> str:
        _clean(value)
        if not pattern.match(value):
            raise ValueError(f"must be {what} (got {value!r})")
        return value

    return check


def _no_traversal(value: str) -> str:
    if ".." in re.split(r"[/:]", value):  # ':' too: binds are src:dst
        raise ValueError(f"'..' path components are not allowed (got {value!r})")
    return value


def _not_an_option(value: str) -> str:
    # Paths, images, URIs and tokenizers are arguments of commands (apptainer, the jobs'
    # argparse): one starting with '-' would be read as an option, '--help' or '--fakeroot'.
    if value.startswith("-"):
        raise ValueError(f"must not start with '-': it would be read as an option (got {value!r})")
    return value


def _path(value: str) -> str:
    _matching(_PATH, "a path of letters, digits and _./@+=:,- (no spaces or shell "
                     "metacharacters)")(value)
    _not_an_option(value)
    return _no_traversal(value)


def _absolute(value: str) -> str:
    _path(value)
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path (got {value!r})")
    return value


def checked_path(name: str, value: str, absolute: bool = True) -> str:
    """The schema's path rule for values computed outside it (run paths, data prefixes)."""
    try:
        return (_absolute if absolute else _path)(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}") from None


def _bind(value: str) -> str:
    _path(value)
    src = value.split(":", 1)[0]
    if not src.startswith("/"):
        raise ValueError(f"a bind is /host/path[:/container/path[:ro|rw]] (got {value!r})")
    return value


def _source(value: str) -> str:
    """A raw corpus: ``demo``, an ``s3://`` / ``hf://`` URI, or a Parquet path or glob.

    URIs are parsed here by the same functions the ingest job uses, so one the job could
    not read fails at DAG parse, naming ``data.source``.
    """
    _clean(value)
    if value == "demo":
        return value
    _not_an_option(value)
    if not _GLOB.match(value):
        raise ValueError("must be 'demo', an s3:// or hf:// URI, or a path/glob of letters, "
                         f"digits and _./@+=:,-*?[] (got {value!r})")
    if _URI.match(value) and not value.startswith(("s3://", "hf://")):
        raise ValueError(f"only s3:// and hf:// URIs are supported (got {value!r})")
    _no_traversal(value)
    if value.startswith("hf://"):
        # The ingest job gets the path in the repository as an argument of its own.
        _not_an_option(parse_hf_uri(value).allow_pattern)
    elif value.startswith("s3://"):
        parse_s3_uri(value)
    return value


# Names a job script cannot export or must not: bash's read-only and special variables
# (``export UID=...`` kills the job under ``set -e``; IFS, BASH_ENV, PS4 change how the script
# itself runs), Slurm's own, the dynamic loader's, and the project's (PP_PYTHON names the
# cluster's Python from the connection's remote_python).
RESERVED_ENV_PREFIXES = ("PP_", "SLURM_", "BASH")
RESERVED_ENV_NAMES = frozenset({
    "SHELLOPTS", "UID", "EUID", "PPID", "GROUPS", "FUNCNAME", "LINENO", "RANDOM", "SRANDOM",
    "SECONDS", "HISTCMD", "OPTIND", "OPTARG", "OPTERR", "IFS", "ENV", "PS1", "PS2", "PS3",
    "PS4", "DIRSTACK", "PIPESTATUS", "EPOCHSECONDS", "EPOCHREALTIME", "POSIXLY_CORRECT",
    "COMP_WORDBREAKS", "MAPFILE", "LD_PRELOAD", "LD_AUDIT", "_"})
MAX_ENV_VALUE = 4096
MAX_ENV_BYTES = 64 << 10  # every exec of the job carries it; Linux allows 128 KiB per string
MAX_ENV_ENTRIES = 128


def env_key(value: str) -> str:
    _matching(_ENV_NAME, "a shell variable name")(value)
    if value in RESERVED_ENV_NAMES or value.startswith(RESERVED_ENV_PREFIXES):
        raise ValueError(f"{value!r} is reserved: bash, Slurm or this project sets it "
                         f"(refused: {', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)} and "
                         "bash's special variables)")
    if any(_SECRET_WORD.match(word) for word in value.upper().split("_")):
        raise ValueError(
            f"{value!r} looks like a secret: the environment is written into the job script "
            "and shown in the Airflow UI; put secrets in an Airflow connection or the "
            "cluster's own environment instead")
    return value


def _env_value(value: str) -> str:
    _clean(value)
    if len(value) > MAX_ENV_VALUE:
        raise ValueError(f"{len(value)} characters: at most {MAX_ENV_VALUE}")
    if _ENV_VALUE_BAD.search(value):
        raise ValueError("values are exported literally (quoted), so $ ` ; | & < > \\ would "
                         f"never be expanded: remove them (got {value!r})")
    return value


def _environment(value: dict[str, str]) -> dict[str, str]:
    size = sum(len(k) + len(v) + 2 for k, v in value.items())
    if len(value) > MAX_ENV_ENTRIES or size > MAX_ENV_BYTES:
        raise ValueError(f"{len(value)} variables, {size} bytes: at most {MAX_ENV_ENTRIES} "
                         f"and {MAX_ENV_BYTES >> 10} KiB (every command of the job carries "
                         "them; too many and exec fails with 'Argument list too long')")
    return value


MAX_TIME_DAYS = 365  # beyond any cluster's limit; Slurm's own field holds minutes


# A word of a set-up line or an entrypoint: what a module name, a path or a flag needs, nothing
# a shell would interpret. shlex.quote leaves such a word as it is.
_WORD = re.compile(r"^[A-Za-z0-9_./@+=:,%-]{1,1024}$")


def command_words(value: str) -> list[str]:
    """A set-up line or an entrypoint as its words (``module load brics/nccl``). Each word
    must be plain: the line is rendered word by word, quoted, so a ``;``, ``$`` or ``|``
    could never start another command; a line that needs them belongs in a script the site
    provides, named here by its path."""
    _clean(value)
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"cannot split {value!r} into words: {exc}") from None
    if not words:
        raise ValueError("must name a command (got an empty line)")
    for word in words:
        if not _WORD.match(word):
            raise ValueError(f"word {word!r} of {value!r}: only letters, digits and "
                             "_./@+=:,%- are allowed (no shell syntax, spaces or quotes)")
    return words


def render_words(value: str) -> str:
    """A checked command line as the shell must see it: each word quoted."""
    return shlex.join(command_words(value))


def _command(value: str) -> str:
    command_words(value)
    return value


def slurm_minutes(value: str) -> int:
    """Slurm's time formats (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) -> minutes,
    rounded up: a limit of 90 s still leaves the job its 2nd minute."""
    m = _SLURM_TIME.match(value) if len(value) <= 16 else None
    if m is None:
        raise ValueError(f"must be a Slurm time such as 30, 04:00:00 or 1-00:00:00 (got {value!r})")
    if m["d"] is not None:
        seconds = (int(m["d"]) * 86400 + int(m["dh"]) * 3600 + int(m["dm"] or 0) * 60
                   + int(m["ds"] or 0))
    elif m["c"] is not None:
        seconds = int(m["a"]) * 3600 + int(m["b"]) * 60 + int(m["c"])
    else:
        seconds = int(m["a"]) * 60 + int(m["b"] or 0)
    if seconds <= 0:
        raise ValueError(f"must be longer than zero (got {value!r})")
    if seconds > MAX_TIME_DAYS * 86400:
        raise ValueError(f"must be at most {MAX_TIME_DAYS} days (got {value!r})")
    if m["a"] is not None and len(m["a"]) > 4:
        # The job spec (and so sbatch's line) takes at most 4 digits before the first ':'.
        raise ValueError(f"write {value!r} with days, e.g. '7-00:00:00'")
    return -(-seconds // 60)


def _slurm_time(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        # YAML 1.1 reads 4:00:00 as the base-60 integer 14400: name the trap.
        raise ValueError(f"got the number {value}; quote Slurm times in YAML, e.g. '04:00:00'")
    if isinstance(value, str):
        _clean(value)
        slurm_minutes(value)
    return value


def _text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("NUL is not allowed")
    return value


def _no_bool(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number (got {value})")
    return value


# --- cron -----------------------------------------------------------------------------------
SCHEDULE_PRESETS = frozenset({"@once", "@continuous", "@hourly", "@daily", "@weekly",
                              "@monthly", "@quarterly", "@yearly", "@annually", "@midnight"})
_CRON_FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day of month", 1, 31, ()),
                ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG",
                                  "SEP", "OCT", "NOV", "DEC")),
                ("day of week", 0, 7, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")))
_CRON_ITEM = re.compile(r"^(?:\*|(?P<lo>\w+)(?:-(?P<hi>\w+))?)(?:/(?P<step>[0-9]+))?$")


def _cron_number(token: str, lo: int, hi: int, names: tuple[str, ...], what: str) -> int:
    if token.upper() in names:
        return names.index(token.upper()) + (1 if what == "month" else 0)
    if not (token.isascii() and token.isdigit()) or not lo <= int(token) <= hi:
        raise ValueError(f"cron {what} field: {token!r} is not in {lo}-{hi}")
    return int(token)


def _schedule(value: str | None) -> str | None:
    if value is None:
        return None
    _clean(value)
    if value.startswith("@"):
        if value not in SCHEDULE_PRESETS:
            raise ValueError(f"unknown preset {value!r}; one of {sorted(SCHEDULE_PRESETS)}")
        return value
    parts = value.split()
    if len(parts) != 5:
        raise ValueError(f"a cron expression has 5 fields (minute hour day month weekday), "
                         f"got {len(parts)} in {value!r}")
    for part, (what, lo, hi, names) in zip(parts, _CRON_FIELDS, strict=True):
        for item in part.split(","):
            m = _CRON_ITEM.match(item)
            if m is None or m["step"] == "0":
                raise ValueError(f"cron {what} field: {item!r} is not *, N, N-M or */S")
            if m["lo"] is not None:
                first = _cron_number(m["lo"], lo, hi, names, what)
                if m["hi"] is not None and _cron_number(m["hi"], lo, hi, names, what) < first:
                    raise ValueError(f"cron {what} field: range {item!r} runs backwards")
    return _airflow_cron(value)


def _airflow_cron(value: str) -> str:
    """The expression as the scheduler will read it: Airflow's own timetable (imported here:
    Airflow is loaded wherever campaigns are), which must also find a next run."""
    from airflow.exceptions import AirflowTimetableInvalid
    from airflow.timetables.base import TimeRestriction
    from airflow.timetables.trigger import CronTriggerTimetable
    from croniter import CroniterBadDateError, CroniterError
    from pendulum import datetime as utc_datetime

    try:
        timetable = CronTriggerTimetable(value, timezone="UTC")
        timetable.validate()
        start = utc_datetime(2026, 1, 1)
        info = timetable.next_dagrun_info(last_automated_data_interval=None,
                                          restriction=TimeRestriction(start, None, False))
    except CroniterBadDateError:
        raise ValueError(f"{value!r} never fires: no date matches it") from None
    except (AirflowTimetableInvalid, CroniterError, ValueError) as exc:
        raise ValueError(f"Airflow refuses {value!r}: {exc}") from None
    if info is None:
        raise ValueError(f"{value!r} never fires")
    return value


# --- the annotated types the schema uses -----------------------------------------------------
INT_MAX = 2**63 - 1  # int64: what Slurm, Megatron and JSON readers take
PosInt = Annotated[int, Strict(), Field(gt=0, le=INT_MAX)]
NonNegInt = Annotated[int, Strict(), Field(ge=0, le=INT_MAX)]
# inf and nan are refused: an 'inf' learning rate or blend weight trains nothing useful.
PosFloat = Annotated[float, BeforeValidator(_no_bool), Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, BeforeValidator(_no_bool), Field(ge=0, allow_inf_nan=False)]
Share = Annotated[float, BeforeValidator(_no_bool), Field(ge=0, le=1, allow_inf_nan=False)]
Slug = Annotated[str, AfterValidator(_matching(_SLUG, "a slug: letters, digits, '_', '-' "
                                                      "(max 64, not starting with '-' or '_')"))]
SlurmName = Annotated[str, AfterValidator(_matching(_SLURM_NAME, "letters, digits, '.', '_', "
                                                                 "'-'"))]
ConnId = Annotated[str, AfterValidator(_matching(_CONN_ID, "an Airflow connection id"))]
SafePath = Annotated[str, AfterValidator(_path)]
AbsPath = Annotated[str, AfterValidator(_absolute)]
Bind = Annotated[str, AfterValidator(_bind)]
Image = Annotated[str, AfterValidator(_path)]  # a .sif path or docker://registry/image:tag
Source = Annotated[str, AfterValidator(_source)]
EnvValue = Annotated[str, AfterValidator(_env_value)]
Environment = Annotated[dict[Annotated[str, AfterValidator(env_key)], EnvValue],
                        AfterValidator(_environment)]
Memory = Annotated[str, AfterValidator(_matching(_MEMORY, "a size such as 64G, or 0 for all"))]
SlurmTime = Annotated[str, BeforeValidator(_slurm_time)]
Schedule = Annotated[str | None, AfterValidator(_schedule)]
Command = Annotated[str, AfterValidator(_command)]  # set-up lines, entrypoints: plain words
Text = Annotated[str, AfterValidator(_text)]  # free text that never reaches a script
